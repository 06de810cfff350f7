"""Replica groups: a node's devices split into independent groups, each fed the least busy."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.protocol import GenerationResult, StepProgress
from kiln.gpu_worker.replicas import Replicas, node_coordinator, split_group
from tests.gpu_worker.conftest import GENEROUS_S, request
from tests.gpu_worker.fixtures import spec
from tests.gpu_worker.fixtures.base import fixture_frames

PIPELINES = {"base": spec("base")}
SLOW_STEPS = 12  # x SLOW_STEP_S (0.05 s): a job long enough that overlap is not chance


def config(devices: str, **options: object) -> GroupConfig:
    return GroupConfig(devices=[devices], pipelines=PIPELINES, **options)  # type: ignore[arg-type]


def test_devices_split_into_groups_of_the_asked_size() -> None:
    whole = config("cpu:4", node_name="n", cpu_threads_per_rank=None)
    groups = split_group(whole, 2)
    assert [g.world() for g in groups] == [["cpu", "cpu"], ["cpu", "cpu"]]
    assert [g.node_name for g in groups] == ["n.g0", "n.g1"]
    # The cores are shared among all the node's ranks, not each group's.
    assert {g.threads_per_rank() for g in groups} == {whole.threads_per_rank()}
    ones = split_group(whole, 1)
    assert len(ones) == 4
    assert {g.parallel.mode for g in ones} == {"none"}  # auto on one rank
    assert split_group(whole, 4) == [whole]
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        split_group(whole, 3)
    assert isinstance(node_coordinator(whole), Coordinator)
    assert isinstance(node_coordinator(whole, 2), Replicas)


def outstanding(replicas: Replicas) -> list[int]:
    """How many requests each group has queued or running."""
    return [group["outstanding"] for group in replicas.stats()["groups"]]


@pytest.fixture(scope="module")
def replicas() -> Iterator[Replicas]:
    """cpu:2 as two groups of one rank."""
    started = Replicas(split_group(config("cpu:2", cpu_threads_per_rank=1, node_name="r"), 1))
    started.start()
    yield started
    started.shutdown()


def test_two_requests_submitted_together_run_at_once_on_the_two_groups(
    replicas: Replicas,
) -> None:
    steps: dict[str, list[float]] = {"a": [], "b": []}
    lock = threading.Lock()

    def on_progress(request_id: str) -> Callable[[StepProgress], None]:
        def record(progress: StepProgress) -> None:
            if progress.stage == "denoising":
                with lock:
                    steps[request_id].append(time.monotonic())

        return record

    first = request("a", prompt="slow a", steps=SLOW_STEPS, seed=3)
    second = request("b", prompt="slow b", steps=SLOW_STEPS, seed=3)
    futures = {
        r.request_id: replicas.submit(r, on_progress=on_progress(r.request_id))
        for r in (first, second)
    }
    assert outstanding(replicas) == [1, 1]  # one each
    results: dict[str, GenerationResult] = {
        rid: future.result(GENEROUS_S) for rid, future in futures.items()
    }
    # Concurrent: each started denoising before the other finished.
    assert steps["a"][0] < steps["b"][-1]
    assert steps["b"][0] < steps["a"][-1]
    for rid, req in (("a", first), ("b", second)):
        (frames,) = results[rid].outputs
        assert np.array_equal(frames, fixture_frames(req, 0))
        metrics = results[rid].metrics
        assert metrics is not None
        assert metrics.batch_size == 1
    stats = replicas.stats()
    assert [g["batches_run"] for g in stats["groups"]] == [1, 1]
    assert (stats["world_size"], stats["group_size"], stats["batches_run"]) == (2, 1, 2)
    assert len(stats["pids"]) == 2
    assert sum(replicas.counters().batch_sizes.values()) == 2  # what the node's metrics read
    assert outstanding(replicas) == [0, 0]  # finished: no longer outstanding


def test_a_busy_group_gets_no_more_until_the_other_has_as_many(replicas: Replicas) -> None:
    long = [request(f"long{i}", prompt="slow", steps=SLOW_STEPS) for i in range(3)]
    futures = []
    for r, after in zip(long, ([1, 0], [1, 1], [2, 1]), strict=True):  # groups 0, 1, then 0
        futures.append(replicas.submit(r))
        assert outstanding(replicas) == after
    with pytest.raises(ValueError, match="already queued or running"):
        replicas.submit(long[0])
    for future in futures:
        future.result(GENEROUS_S)
    assert replicas.stats()["jobs_queued"] == 0
    assert outstanding(replicas) == [0, 0]
