"""How the `kiln` command line ends: exit codes, the one-line usage error, JSON output."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

EXIT_JOB_FAILED = 1  # a job ended badly, or a service refused the request
EXIT_USAGE = 2  # a mistake in the command line, a setting or a job request
EXIT_WAIT_TIMEOUT = 3  # `--timeout` ran out before the jobs finished
EXIT_NOT_SERVED = 4  # no live node serves the job's pipeline (see --wait-for-node)
EXIT_ALREADY_FINISHED = 5  # `kiln cancel`: the job had finished; nothing was canceled
EXIT_PIPE_CLOSED = 141  # the reader of the output went away (`| head`), as SIGPIPE would end it


class UsageError(Exception):
    """A mistake in what the user asked for; printed as one line."""


class _PipeConsole(Console):
    """A rich console whose closed pipe raises BrokenPipeError (rich itself exits with 1)."""

    def on_broken_pipe(self) -> None:
        """Stop writing; `cli.main` ends the command quietly."""
        self.quiet = True
        raise BrokenPipeError


def stdout_console() -> Console:
    """The console for a command's output on stdout."""
    return _PipeConsole()


def print_json(data: Any) -> None:
    """JSON output for `--json`."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
