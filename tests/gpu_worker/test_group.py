"""WorkerGroup lifecycle: start, titles, idle CPU, startup failure, death, shutdown.

Orphans (a SIGKILLed parent leaves no rank): test_rank_server.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.errors import RankStartupFailed
from kiln.gpu_worker.group import WorkerGroup
from tests.gpu_worker.conftest import CLOCK_TICKS, cpu_ticks, process_gone
from tests.gpu_worker.fixtures import fails_to_load, spec
from tests.waiting import wait_until

IDLE_WINDOW_S = 3.0
IDLE_CPU_LIMIT = 0.05  # of one core, per rank


def config(ranks: int, pipelines: dict[str, str] | None = None, **options: object) -> GroupConfig:
    """A CPU group of `ranks` ranks serving the well-behaved fixture."""
    return GroupConfig(
        devices=[f"cpu:{ranks}"],
        pipelines=pipelines or {"base": spec("base")},
        cpu_threads_per_rank=1,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def idle_group() -> Iterator[WorkerGroup]:
    """A started 2-rank group that the tests of this module only observe."""
    group = WorkerGroup(config(2, node_name="idle-node"))
    group.start()
    yield group
    group.shutdown()


def test_ranks_are_named_by_node_rank_and_role(idle_group: WorkerGroup) -> None:
    titles = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in idle_group.pids]
    assert b"[idle-node] rank 0/2 leader cpu" in titles[0]
    assert b"[idle-node] rank 1/2 follower cpu" in titles[1]


def test_idle_group_uses_no_cpu(idle_group: WorkerGroup) -> None:
    before = {pid: cpu_ticks(pid) for pid in idle_group.pids}
    started = time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    elapsed = time.monotonic() - started
    used = {pid: (cpu_ticks(pid) - ticks) / CLOCK_TICKS / elapsed for pid, ticks in before.items()}
    print(f"idle CPU per rank over {elapsed:.1f} s (fraction of one core): {used}")
    assert all(fraction < IDLE_CPU_LIMIT for fraction in used.values()), used


def test_shutdown_asks_first_and_leaves_no_process() -> None:
    group = WorkerGroup(config(2))
    group.start()
    pids = group.pids
    assert len(pids) == 2
    assert not any(process_gone(pid) for pid in pids)
    group.shutdown()
    assert all(process_gone(pid) for pid in pids)
    # Asked nicely, every rank exits by itself with 0 (no SIGTERM, no SIGKILL needed).
    assert [p.exitcode for p in group._ranks.processes] == [0, 0]
    group.shutdown()  # idempotent


def test_rank_that_fails_to_load_reports_its_error() -> None:
    group = WorkerGroup(config(2, {"broken": spec("fails_to_load")}))
    with pytest.raises(RankStartupFailed) as failure:
        group.start()
    assert "rank 1 failed to start" in str(failure.value)
    assert fails_to_load.MESSAGE in str(failure.value)
    assert "FileNotFoundError" in str(failure.value)
    assert all(process_gone(pid) for pid in group.pids)


def test_a_killed_rank_is_reported_once_and_the_rest_are_stopped() -> None:
    deaths: list[str] = []
    reported = threading.Event()

    def on_death(reason: str) -> None:
        deaths.append(reason)
        reported.set()

    group = WorkerGroup(config(2), on_death=on_death)
    group.start()
    leader, follower = group.pids
    os.kill(follower, signal.SIGKILL)
    assert reported.wait(60)
    assert deaths == [f"rank 1 (pid {follower}) killed by SIGKILL"]
    wait_until(lambda: process_gone(leader), what=f"leader {leader} gone")
    assert not group.alive
    group.shutdown()
