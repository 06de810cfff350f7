"""The coordinator on 1 and 2 CPU ranks with the tiny pipeline.

Outputs, seeds, parallelism, batching, progress and stopping.

"tiny" here is the tiny SD-style pipeline loaded through `load_pipeline("tiny")`, wrapped by the
counting fixture so that each rank logs what its denoiser computed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.errors import JobStopped
from kiln.gpu_worker.parallel import ParallelSpec
from kiln.gpu_worker.protocol import GenerationResult, StepProgress
from tests.gpu_worker.conftest import GENEROUS_S, request, start_coordinator
from tests.gpu_worker.fixtures import spec
from tests.gpu_worker.fixtures.base import STEP_LOG_ENV
from tests.gpu_worker.fixtures.counting import COUNT_LOG_ENV

PIPELINES = {"tiny": spec("counting"), "base": spec("base")}
# A forward over another batch shape (a batch of 4, a slice of a split batch) takes other CPU
# kernel paths; float rounding can then move a pixel by one level out of 255, never more.
PIXEL_TOLERANCE = 1


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Step and denoiser-count logs, named in the environment the ranks inherit at spawn."""
    folder = tmp_path_factory.mktemp("rank-logs")
    saved = {name: os.environ.get(name) for name in (STEP_LOG_ENV, COUNT_LOG_ENV)}
    os.environ[STEP_LOG_ENV] = str(folder / "steps.log")
    os.environ[COUNT_LOG_ENV] = str(folder / "counts.log")
    yield folder
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def one_rank(logs: Path) -> Iterator[Coordinator]:
    """One CPU rank, no parallelism; also serves the tiny text-to-video pipeline."""
    del logs  # requested so the log paths are in the environment before the ranks spawn
    pipelines = {**PIPELINES, "video": "tiny-video"}
    coordinator = start_coordinator("cpu:1", pipelines, node_name="one")
    yield coordinator
    coordinator.shutdown()


@pytest.fixture(scope="module")
def two_ranks(logs: Path) -> Iterator[Coordinator]:
    """Two CPU ranks splitting each batch between them."""
    del logs  # requested so the log paths are in the environment before the ranks spawn
    coordinator = start_coordinator(
        "cpu:2", PIPELINES, parallel=ParallelSpec(mode="batch"), node_name="two"
    )
    yield coordinator
    coordinator.shutdown()


@pytest.fixture(params=["one_rank", "two_ranks"])
def coordinator(request: pytest.FixtureRequest) -> Coordinator:
    """Each test below runs on one and on two ranks."""
    coordinator: Coordinator = request.getfixturevalue(request.param)
    return coordinator


def generate(coordinator: Coordinator, request_id: str, **fields: object) -> GenerationResult:
    """Submit a tiny request and wait for its result."""
    fields.setdefault("steps", 4)
    future = coordinator.submit(request(request_id, "tiny", **fields))  # type: ignore[arg-type]
    return future.result(GENEROUS_S)


def max_difference(first: GenerationResult, second: GenerationResult) -> int:
    """Largest per-pixel difference between the outputs of two results."""
    pairs = zip(first.outputs, second.outputs, strict=True)
    return max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) for a, b in pairs)


def test_images_come_out_right(coordinator: Coordinator) -> None:
    result = generate(coordinator, "images", num_outputs=2)
    assert result.request_id == "images"
    assert [o.shape for o in result.outputs] == [(1, 64, 64, 3)] * 2
    assert all(o.dtype == np.uint8 for o in result.outputs)
    assert not np.array_equal(result.outputs[0], result.outputs[1])  # seeds differ per output
    assert result.metrics is not None
    assert (result.metrics.batch_size, result.metrics.steps_run) == (2, 4)
    assert result.metrics.peak_memory_mb > 0


def test_a_short_video_comes_out_with_its_frames(one_rank: Coordinator) -> None:
    future = one_rank.submit(request("video", "video", steps=3, size=32, num_frames=9))
    result = future.result(GENEROUS_S)
    assert [o.shape for o in result.outputs] == [(9, 32, 32, 3)]
    assert result.outputs[0].dtype == np.uint8
    assert not np.array_equal(result.outputs[0][0], result.outputs[0][-1])  # frames differ


def test_same_seed_gives_the_same_pixels(coordinator: Coordinator) -> None:
    first = generate(coordinator, "seed-a", seed=42)
    again = generate(coordinator, "seed-b", seed=42)
    other = generate(coordinator, "seed-c", seed=43)
    assert np.array_equal(first.outputs[0], again.outputs[0])
    assert not np.array_equal(first.outputs[0], other.outputs[0])


def test_two_ranks_give_the_one_rank_output(one_rank: Coordinator, two_ranks: Coordinator) -> None:
    alone = generate(one_rank, "split-1", seed=5, num_outputs=2)
    split = generate(two_ranks, "split-2", seed=5, num_outputs=2)
    assert max_difference(alone, split) <= PIXEL_TOLERANCE


def test_batch_split_makes_each_rank_compute_half(two_ranks: Coordinator, logs: Path) -> None:
    counts = logs / "counts.log"
    seen = len(counts.read_text().splitlines()) if counts.exists() else 0
    generate(two_ranks, "halves", num_outputs=2, guidance_scale=5.0)
    lines = [line.split() for line in counts.read_text().splitlines()[seen:]]
    by_rank = {
        int(rank): (int(steps), int(calls), int(rows)) for rank, steps, calls, rows, _ in lines
    }
    # 2 outputs with classifier-free guidance = 4 rows per step, 4 steps = 16 rows in all.
    assert by_rank == {0: (4, 4, 8), 1: (4, 4, 8)}


def test_four_compatible_requests_share_one_forward_and_match_separate_runs(
    coordinator: Coordinator,
) -> None:
    seeds = [11, 12, 13, 14]
    separate = [generate(coordinator, f"alone-{seed}", seed=seed) for seed in seeds]
    # Keep the group busy so the four queue up behind it: one batch, whatever the timing.
    busy = coordinator.submit(request("busy", "base", "slow", steps=20))
    futures = [coordinator.submit(request(f"batched-{s}", "tiny", steps=4, seed=s)) for s in seeds]
    busy.result(GENEROUS_S)
    batched = [future.result(GENEROUS_S) for future in futures]
    for alone, together in zip(separate, batched, strict=True):
        assert together.metrics is not None
        assert together.metrics.batch_size == 4
        assert max_difference(alone, together) <= PIXEL_TOLERANCE


def test_progress_is_reported_after_every_step(coordinator: Coordinator) -> None:
    seen: list[StepProgress] = []
    future = coordinator.submit(request("progress", "tiny", steps=3), on_progress=seen.append)
    future.result(GENEROUS_S)
    stages = [(p.stage, p.step, p.total) for p in seen]
    assert stages == [
        ("denoising", 1, 3),
        ("denoising", 2, 3),
        ("denoising", 3, 3),
        ("decoding", 3, 3),
    ]


def test_a_request_stopped_at_step_k_runs_at_most_k_plus_one_steps(
    coordinator: Coordinator, logs: Path
) -> None:
    stop_at, total = 3, 30
    seen: list[int] = []
    request_id = f"stop-{len(coordinator.stats()['pids'])}"
    future = coordinator.submit(
        request(request_id, "base", steps=total),
        on_progress=lambda progress: seen.append(progress.step),
        should_stop=lambda: bool(seen) and seen[-1] >= stop_at,
    )
    with pytest.raises(JobStopped):
        future.result(GENEROUS_S)
    steps_by_pid: dict[str, int] = {}
    for line in (logs / "steps.log").read_text().splitlines():
        pid, _rank, ids, step = line.split()
        if ids == request_id:
            steps_by_pid[pid] = max(steps_by_pid.get(pid, 0), int(step))
    assert len(steps_by_pid) == coordinator.stats()["world_size"]
    assert all(steps <= stop_at + 1 for steps in steps_by_pid.values()), steps_by_pid


def test_stats_describe_the_group(coordinator: Coordinator) -> None:
    stats = coordinator.stats()
    assert stats["group_alive"]
    assert stats["jobs_running"] == 0
    assert {"base", "tiny"} <= set(stats["pipelines"])
    assert len(stats["pids"]) == stats["world_size"]
    assert stats["last_progress_at"] is not None
