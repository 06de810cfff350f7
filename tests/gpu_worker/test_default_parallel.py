"""The default parallelism (`auto`): several devices never compute the same rows twice.

Groups here are started without a `parallel` option, as `kiln worker --devices cpu:2` starts them.
They serve the tiny SD-style pipeline wrapped by the counting fixture, so each rank logs what its
denoiser computed; the same request on one rank is the reference for both counts and pixels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.parallel import ParallelSpec
from kiln.gpu_worker.protocol import GenerationResult
from tests.gpu_worker.conftest import GENEROUS_S, request, start_coordinator
from tests.gpu_worker.fixtures import spec
from tests.gpu_worker.fixtures.counting import COUNT_LOG_ENV

PIPELINES = {"tiny": spec("counting")}
STEPS = 4
# Another batch shape takes other CPU kernel paths: a pixel may move one level out of 255.
PIXEL_TOLERANCE = 1

RankCounts = dict[int, tuple[int, int, int]]  # rank -> (calls, rows, idle_calls) of one run


@pytest.fixture(scope="module")
def count_log(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The counting fixture's log, named in the environment the ranks inherit at spawn."""
    path = tmp_path_factory.mktemp("auto-counts") / "counts.log"
    with patch.dict(os.environ, {COUNT_LOG_ENV: str(path)}):
        yield path


@pytest.fixture(scope="module")
def one_rank(count_log: Path) -> Iterator[Coordinator]:
    """One CPU rank, default options."""
    del count_log  # requested so the log path is in the environment before the ranks spawn
    coordinator = start_coordinator("cpu:1", PIPELINES, node_name="auto-one")
    yield coordinator
    coordinator.shutdown()


@pytest.fixture(scope="module")
def two_ranks(count_log: Path) -> Iterator[Coordinator]:
    """Two CPU ranks, default options."""
    del count_log  # requested so the log path is in the environment before the ranks spawn
    coordinator = start_coordinator("cpu:2", PIPELINES, node_name="auto-two")
    yield coordinator
    coordinator.shutdown()


def generate(
    coordinator: Coordinator, count_log: Path, request_id: str, **fields: object
) -> tuple[GenerationResult, RankCounts]:
    """Run one tiny request; return its result and what each rank's denoiser did for it."""
    seen = len(count_log.read_text().splitlines()) if count_log.exists() else 0
    future = coordinator.submit(request(request_id, "tiny", steps=STEPS, seed=5, **fields))  # type: ignore[arg-type]
    result = future.result(GENEROUS_S)
    # Every rank logs before the outcome exchange that precedes the result, so all lines are in.
    lines = [line.split() for line in count_log.read_text().splitlines()[seen:]]
    counts = {int(rank): (int(calls), int(rows), int(idle)) for rank, _, calls, rows, idle in lines}
    return result, counts


def max_difference(first: GenerationResult, second: GenerationResult) -> int:
    """Largest per-pixel difference between the outputs of two results."""
    pairs = zip(first.outputs, second.outputs, strict=True)
    return max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) for a, b in pairs)


def test_the_default_is_auto_and_one_rank_divides_nothing() -> None:
    assert GroupConfig(devices=["cpu:2"], pipelines=PIPELINES).parallel.mode == "auto"
    assert GroupConfig(devices=["cpu"], pipelines=PIPELINES).parallel.mode == "none"


def test_two_outputs_are_computed_once_across_two_ranks(
    one_rank: Coordinator, two_ranks: Coordinator, count_log: Path
) -> None:
    alone, alone_counts = generate(one_rank, count_log, "two-outputs-1", num_outputs=2)
    split, split_counts = generate(two_ranks, count_log, "two-outputs-2", num_outputs=2)
    # 2 outputs with classifier-free guidance: 4 rows per step, 16 over 4 steps.
    assert alone_counts == {0: (STEPS, 16, 0)}
    assert split_counts == {0: (STEPS, 8, 0), 1: (STEPS, 8, 0)}
    assert max_difference(alone, split) <= PIXEL_TOLERANCE


def test_a_forward_of_one_row_leaves_the_second_rank_idle(
    one_rank: Coordinator, two_ranks: Coordinator, count_log: Path
) -> None:
    # No guidance, one output: one row per step, which only one rank can take.
    alone, alone_counts = generate(one_rank, count_log, "one-row-1", guidance_scale=1.0)
    split, split_counts = generate(two_ranks, count_log, "one-row-2", guidance_scale=1.0)
    assert alone_counts == {0: (STEPS, STEPS, 0)}
    assert split_counts == {0: (STEPS, STEPS, 0), 1: (STEPS, 0, STEPS)}
    assert max_difference(alone, split) <= PIXEL_TOLERANCE


def test_none_on_several_ranks_is_refused_before_any_rank_starts() -> None:
    GroupConfig(devices=["cpu"], pipelines=PIPELINES, parallel=ParallelSpec("none"))
    with pytest.raises(ValueError, match="'none' on 2 ranks makes every rank compute every job"):
        GroupConfig(devices=["cpu:2"], pipelines=PIPELINES, parallel=ParallelSpec("none"))


def test_a_cuda_device_the_machine_lacks_is_refused_before_any_rank_starts() -> None:
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last visible GPU, or cuda:0
    with pytest.raises(ValueError, match=f"^{absent} asked for, but "):
        GroupConfig(devices=[absent], pipelines=PIPELINES)
