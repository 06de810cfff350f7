"""A job command run with `--api` closes its connection to the API when it returns.

In-process `main()` against a real API: a command that left its kept-alive connection to the
garbage collector would warn (an unclosed socket) when the client is freed, at some later moment
of whatever runs in the process then.
"""

from __future__ import annotations

import gc
import warnings

import pytest

from kiln.tasks.cli.exits import EXIT_JOB_FAILED
from kiln.tasks.cli.main import EXIT_USAGE, main
from tests.tasks.helpers import Api, queued_job


def unclosed_sockets_to(api: Api, argv: list[str]) -> tuple[int, list[str]]:
    """`main(argv)`'s exit code and the unclosed-socket warnings naming the API's port."""
    port = api.url.rsplit(":", 1)[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        code = main(argv)
        gc.collect()  # a client left in a reference cycle is freed here, not in a later test
    named = [
        str(warning.message)
        for warning in caught
        if issubclass(warning.category, ResourceWarning) and f", {port})" in str(warning.message)
    ]
    return code, named


def test_every_job_command_closes_its_connection(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = ["--api", api.url, "--api-key", api.keys["alice"]]
    job_id = queued_job(api.store, owner=api.key_ids["alice"])
    commands = [
        (["submit", "a kiln", "--pipeline", "tiny", "--width", "64", "--height", "64"], 0),
        # a bound the pipeline declares: the command asks the API for the pipeline's limits
        (["submit", "waves", "--pipeline", "tiny", "--width", "100000"], EXIT_USAGE),
        (["status", job_id], 0),
        (["jobs", "--json"], 0),
        (["cancel", job_id], 0),
        (["wait", job_id], EXIT_JOB_FAILED),  # canceled
        (["get", job_id], EXIT_JOB_FAILED),  # a canceled job has no outputs
    ]
    for argv, expected in commands:
        code, unclosed = unclosed_sockets_to(api, [*argv, *remote])
        assert (argv[0], code, unclosed) == (argv[0], expected, [])
    capsys.readouterr()
