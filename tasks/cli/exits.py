"""How the `kiln` command line ends: exit codes, the one-line usage error, JSON output."""

from __future__ import annotations

import json
from typing import Any

EXIT_JOB_FAILED = 1  # a job ended badly, or a service refused the request
EXIT_USAGE = 2  # a mistake in the command line, a setting or a job request
EXIT_WAIT_TIMEOUT = 3  # `--timeout` ran out before the jobs finished
EXIT_NOT_SERVED = 4  # no live node serves the job's pipeline (see --wait-for-node)


class UsageError(Exception):
    """A mistake in what the user asked for; printed as one line."""


def print_json(data: Any) -> None:
    """JSON output for `--json`."""
    print(json.dumps(data, indent=2, sort_keys=True, default=str))
