"""Sleep and wake of a worker group on CPU ranks (gpu_worker/sleep.py, gpu_worker/ranks/sleep.py).

An idle group sleeps after `idle_sleep_s`; the next job wakes every rank and carries the wake in
its metrics; a job racing the sleep is neither lost nor run twice; `drop` gives the weights' host
memory back; the outputs after a wake are the outputs before it.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.protocol import GenerationResult
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.conftest import GENEROUS_S, request, start_coordinator
from tests.gpu_worker.fixtures import spec
from tests.gpu_worker.fixtures.base import STEP_LOG_ENV
from tests.gpu_worker.fixtures.weighty import WEIGHT_MB
from tests.waiting import wait_until

IDLE_SLEEP_S = 1.0  # long enough that a test thread always beats it to the next job
PIPELINES = {"weighty": spec("weighty")}


@pytest.fixture(scope="module")
def step_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every step every rank runs, in a file named in the environment the ranks inherit."""
    path = tmp_path_factory.mktemp("sleep-steps") / "steps.log"
    saved = os.environ.get(STEP_LOG_ENV)
    os.environ[STEP_LOG_ENV] = str(path)
    yield path
    if saved is None:
        os.environ.pop(STEP_LOG_ENV, None)
    else:
        os.environ[STEP_LOG_ENV] = saved


@pytest.fixture(scope="module")
def dropping(step_log: Path) -> Iterator[Coordinator]:
    """Two CPU ranks that drop their pipelines after IDLE_SLEEP_S without work."""
    del step_log  # requested so the ranks log their steps
    settings = GpuWorkerSettings(idle_sleep_s=IDLE_SLEEP_S, sleep_mode="drop")
    coordinator = start_coordinator("cpu:2", PIPELINES, settings=settings, node_name="drop")
    yield coordinator
    coordinator.shutdown()


@pytest.fixture(scope="module")
def offloading() -> Iterator[Coordinator]:
    """One CPU rank in offload mode (modules stay on the CPU: nothing moves, nothing is freed)."""
    settings = GpuWorkerSettings(idle_sleep_s=IDLE_SLEEP_S, sleep_mode="offload")
    coordinator = start_coordinator("cpu:1", PIPELINES, settings=settings, node_name="offload")
    yield coordinator
    coordinator.shutdown()


def run(coordinator: Coordinator, request_id: str, pipeline: str) -> GenerationResult:
    """One small job, waited for."""
    job = request(request_id, pipeline, size=64, steps=2, seed=7)
    return coordinator.submit(job).result(GENEROUS_S)


def fall_asleep(coordinator: Coordinator) -> dict[str, object]:
    """Wait until the group, awake now, sleeps and rank 0 reports it; the stats then."""
    earlier = coordinator.stats()["last_sleep"]  # a report of an earlier sleep, or None
    wait_until(lambda: coordinator.stats()["last_sleep"], lambda last: last != earlier)
    stats = coordinator.stats()
    assert stats["asleep"] is True
    return stats


@pytest.mark.parametrize("group", ["dropping", "offloading"])
def test_a_sleeping_group_wakes_for_the_next_job_with_the_same_outputs(
    group: str, request: pytest.FixtureRequest
) -> None:
    coordinator: Coordinator = request.getfixturevalue(group)
    check_wakes_with_the_same_outputs(coordinator, group, "weighty")


@pytest.mark.slow
def test_a_dropped_diffusers_pipeline_reloads_from_the_model_cache_on_wake() -> None:
    settings = GpuWorkerSettings(idle_sleep_s=IDLE_SLEEP_S, sleep_mode="drop")
    coordinator = start_coordinator("cpu:1", {"tiny": "tiny"}, settings=settings)
    try:
        check_wakes_with_the_same_outputs(coordinator, "tiny-drop", "tiny")
    finally:
        coordinator.shutdown()


def check_wakes_with_the_same_outputs(coordinator: Coordinator, group: str, pipeline: str) -> None:
    """Awake job, sleep, a job that wakes the group: same pixels, wake counted once."""
    awake = run(coordinator, f"{group}-{pipeline}-awake", pipeline)
    assert awake.metrics is not None
    wakes_before = coordinator.stats()["wakes"]
    stats = fall_asleep(coordinator)
    assert stats["sleep_mode"] == ("offload" if group == "offloading" else "drop")

    woken = run(coordinator, f"{group}-{pipeline}-woken", pipeline)

    assert woken.metrics is not None
    assert woken.metrics.wake_s > 0
    after = coordinator.stats()
    assert after["asleep"] is False
    assert after["wakes"] == wakes_before + 1
    for before, now in zip(awake.outputs, woken.outputs, strict=True):
        np.testing.assert_array_equal(before, now)  # reloaded weights compute the same pixels
    again = run(coordinator, f"{group}-{pipeline}-again", pipeline)
    assert again.metrics is not None
    assert again.metrics.wake_s == 0.0


def test_drop_gives_the_weights_host_memory_back(dropping: Coordinator) -> None:
    run(dropping, "memory-awake", "weighty")
    stats = fall_asleep(dropping)
    report = stats["last_sleep"]
    assert isinstance(report, dict)
    freed_mb = report["before"]["rss_mb"] - report["after"]["rss_mb"]
    # Most of the weights come back to the OS (the C heap is trimmed), and they count in RSS.
    assert freed_mb > 0.8 * WEIGHT_MB, report
    assert report["before"]["rss_mb"] > WEIGHT_MB


def test_jobs_racing_the_sleep_run_once_each(dropping: Coordinator, step_log: Path) -> None:
    ids = [f"race-{index}" for index in range(4)]
    for index, request_id in enumerate(ids):
        future = dropping.submit(request(request_id, "weighty", size=64, steps=2, seed=index))
        assert future.result(GENEROUS_S).metrics is not None
        # Idle for about the threshold, so the next job lands before the timer fires, while the
        # ranks are falling asleep, or once they sleep (spacing only; nothing timed is checked).
        time.sleep(IDLE_SLEEP_S * (0.5 + 0.25 * (index % 4)))
    steps = Counter(
        (line.split()[1], line.split()[2]) for line in step_log.read_text().splitlines()
    )
    for request_id in ids:
        assert steps[("0", request_id)] == 2, request_id  # rank 0 ran it once: 2 steps
        assert steps[("1", request_id)] == 2, request_id  # and so did rank 1
    assert dropping.stats()["sleeps"] >= 2
