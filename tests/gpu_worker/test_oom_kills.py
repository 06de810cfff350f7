"""A rank the kernel kills for memory.

The request fails as OutOfMemory (not retryable) instead of WorkerGroupDied, which would run it
again and kill the rebuilt group each time.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.gpu_worker import group_monitor
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.errors import OutOfMemory
from kiln.gpu_worker.oom_kills import oom_kill_count
from tests.gpu_worker.conftest import GENEROUS_S, request
from tests.gpu_worker.fixtures import spec
from tests.waiting import wait_until


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_counter_is_read_from_cgroup_v2_and_v1(tmp_path: Path) -> None:
    v2 = write(tmp_path / "v2" / "proc", "0::/kiln.slice/node\n")
    write(tmp_path / "v2" / "kiln.slice/node/memory.events", "low 0\noom 3\noom_kill 2\n")
    assert oom_kill_count(tmp_path / "v2", v2) == 2
    v1 = write(tmp_path / "v1" / "proc", "9:cpu:/\n4:memory:/docker/abc\n0::/\n")
    oom_control = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"
    write(tmp_path / "v1" / "memory/docker/abc/memory.oom_control", oom_control)
    assert oom_kill_count(tmp_path / "v1", v1) == 5
    # A container sees its own cgroup at the namespace root, whatever /proc/self/cgroup says.
    write(tmp_path / "ns" / "memory/memory.oom_control", oom_control)
    assert oom_kill_count(tmp_path / "ns", v1) == 5
    assert oom_kill_count(tmp_path / "none", tmp_path / "missing") is None


def test_a_rank_killed_by_the_oom_killer_fails_its_request_as_out_of_memory(
    coordinator_factory: Callable[..., Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel's counter, stood in for: a real OOM kill cannot be caused safely on a shared
    # test machine. The group reads it when it starts and when a rank dies.
    kills = [0]
    monkeypatch.setattr(group_monitor, "oom_kill_count", lambda: kills[0])
    coordinator = coordinator_factory("cpu:1", {"hangs": spec("hangs")}, warmup=False)
    future = coordinator.submit(request("too-big", "hangs", "hang here"))
    wait_until(
        lambda: coordinator.stats()["jobs_running"], lambda n: n == 1, what="one job running"
    )
    kills[0] += 1  # what the kernel counts as it kills the rank
    os.kill(coordinator.stats()["pids"][0], signal.SIGKILL)
    with pytest.raises(OutOfMemory) as failure:
        future.result(GENEROUS_S)
    assert not failure.value.retryable
    assert "out-of-memory killer" in str(failure.value)
    after = coordinator.submit(request("after", "hangs")).result(GENEROUS_S)
    assert after.outputs
    assert coordinator.stats()["rebuilds"] == 1
