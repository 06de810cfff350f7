"""The suite's one polling loop: what it returns, and what its failures say."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_for_changes, wait_for_line, wait_until


def test_returns_the_first_value_that_holds() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), lambda n: n >= 3, poll_s=0) == 3


def test_a_timeout_names_what_and_the_last_value_seen() -> None:
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: {"state": "queued"}, lambda r: r["state"] == "done", timeout_s=0.05,
                   what="job done")  # fmt: skip
    assert "job done" in str(failed.value)
    assert "last seen: {'state': 'queued'}" in str(failed.value)


def test_a_failing_observation_ends_the_wait_at_once() -> None:
    def observe() -> bool:
        raise AssertionError("the node exited")

    with pytest.raises(AssertionError, match="the node exited"):
        wait_until(observe, timeout_s=3600)


def test_changes_are_counted_from_the_value_at_the_start() -> None:
    values = iter([5, 5, 6, 6, 6, 7])
    seen = []

    def observe() -> int:
        seen.append(next(values))
        return seen[-1]

    wait_for_changes(observe, 2, timeout_s=60)
    assert seen == [5, 5, 6, 6, 6, 7]  # stopped at the second change, not before
    with pytest.raises(AssertionError, match="last seen: 0"):
        wait_for_changes(lambda: 1, 1, timeout_s=0.05)  # no change: 0 changes seen


def test_a_line_is_found_and_an_exit_without_it_fails_at_once(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    script = "import sys; print('starting'); print('ready on 8000'); sys.stdout.flush()"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-c", script], stdout=out)
    assert wait_for_line(log, "ready on", process) == "ready on 8000"
    process.wait(60)
    with pytest.raises(AssertionError, match="exited with no line with 'never'") as failed:
        wait_for_line(log, "never", process, timeout_s=3600)
    assert "starting" in str(failed.value)  # the log's tail
