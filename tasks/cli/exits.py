"""How the `kiln` command line ends: exit codes, the one-line usage error, JSON output.

Imported by every command before it starts (`kiln worker` among them, whose refusals must come
quickly): the standard library only. The console for text output is `cli.consoles`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_JOB_FAILED = 1  # a job ended badly, or a service refused the request
EXIT_USAGE = 2  # a mistake in the command line, a setting or a job request
EXIT_WAIT_TIMEOUT = 3  # `--timeout` ran out before the jobs finished
EXIT_NOT_SERVED = 4  # no live node serves the job's pipeline (see --wait-for-node)
EXIT_ALREADY_FINISHED = 5  # `kiln cancel`: the job had finished; nothing was canceled
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it; a job waited on goes on
EXIT_PIPE_CLOSED = 141  # the reader of the output went away (`| head`), as SIGPIPE would end it


class UsageError(Exception):
    """A mistake in what the user asked for; printed as one line."""


def say_stopped_waiting(args: argparse.Namespace, goes_on: str, follow: str) -> None:
    """Ctrl-C's line on stderr: what `goes_on`, and the `follow` command (with its `--api`)."""
    remote = f" --api {args.api}" if getattr(args, "api", None) else ""
    print(
        f"kiln: stopped waiting; {goes_on} — follow with: {follow}{remote}",
        file=sys.stderr,
        flush=True,
    )


def print_json(data: Any) -> None:
    """JSON output for `--json`."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
