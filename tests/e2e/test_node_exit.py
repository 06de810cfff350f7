"""An idle node exits promptly on SIGTERM; a busy one keeps the drain contract (test_recovery.py).

A real `kiln worker` (its Celery worker, its rank group) with JSON logs, after one job, so that
everything a node starts lazily (shared memory, multiprocessing's resource tracker) exists.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, WorkerProcess, child_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# Waits an idle node must not sit in: each is set far above the bound below.
SLOW_GRACES = {"KILN_DRAIN_GRACE_S": "60", "KILN_SHUTDOWN_GRACE_S": "60"}
# What an idle node's exit legitimately costs: Celery closing its consumer (which reads the
# answer of its pending BRPOP: kombu's `brpop_timeout`, 1 s), the ranks leaving on request, one
# maintenance-loop turn, process teardown. Measured 0.9-1.5 s on 2 shared cores (the code before
# this test took 6.5-13.7 s, JSON logs on). Not derivable from a setting: it is a wall-clock
# bound, kept 3x over the measured time for a loaded machine, and under every wait it guards
# against (the graces above, the controls' 2 s reply timeout per queue, 2 s per captured stream).
IDLE_EXIT_BOUND_S = 5.0


def idle_node(cluster_factory: Callable[..., Cluster]) -> tuple[Cluster, WorkerProcess]:
    cluster = cluster_factory(KILN_LOG_FORMAT="json", **SLOW_GRACES)
    worker = cluster.start_worker("tiny")
    job_id = cluster.submit(pipeline="tiny", prompt="x", width=64, height=64, steps=2)
    assert str(cluster.wait_for(job_id).state) == "succeeded"
    return cluster, worker


def stdio_targets(pid: int) -> tuple[str, str]:
    """What a process's fds 1 and 2 point at ('pipe:[inode]', a file path...)."""
    return os.readlink(f"/proc/{pid}/fd/1"), os.readlink(f"/proc/{pid}/fd/2")


def resource_tracker_pid(worker: WorkerProcess) -> int:
    for pid in child_pids(worker.process.pid):
        if b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    raise AssertionError("the node has no resource tracker (no rank spawned?)")


def test_an_idle_node_exits_promptly_on_sigterm(
    cluster_factory: Callable[..., Cluster],
) -> None:
    _, worker = idle_node(cluster_factory)
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    code = worker.process.wait(60)
    took = time.monotonic() - started
    assert code == 0, worker.log()
    assert took < IDLE_EXIT_BOUND_S, f"an idle node took {took:.1f}s to exit:\n{worker.log()}"


def test_the_resource_tracker_does_not_hold_the_captured_log_pipes(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """It lives until the node exits: holding fds 1 and 2, it would stall the capture's stop."""
    _, worker = idle_node(cluster_factory)
    captured = set(stdio_targets(worker.process.pid))  # the capture's pipes (JSON logs)
    assert all(target.startswith("pipe:") for target in captured)
    assert captured.isdisjoint(stdio_targets(resource_tracker_pid(worker)))
