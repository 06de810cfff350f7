"""Speed modes on a group that divides the forward: 2 ranks from the rank server, gloo on 127.0.0.1.

Under context parallelism each rank's first block sees half the sequence, so the change First
Block Cache measures differs between the ranks. The ranks first run `fast` with a zero threshold
(nothing skipped) and record the change each one measures on its own slice at every call; the
test threshold is then put between the two slices' changes at a call, so that a per-rank
decision would skip on one rank and compute on the other (the other then waits in the
attention's all-to-all until gloo's timeout fails it). With the decision made on the summed
changes (gpu_worker/speed.py) both ranks decide alike, skip what one rank holding the whole
sequence skips, and make the same image.

Tolerance: a context-parallel image may differ from the 1-rank image by at most 1 level of 255
per pixel (attention computed over all-to-all'd heads sums in another order on CPU), as in
test_parallel.py; the two ranks agree exactly.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
import torch.distributed as dist

from kiln.gpu_worker.parallel import ParallelSpec, apply_parallel, denoiser_counters
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.gpu_worker.speed import cache_blocks
from tests.gpu_worker.conftest import run_served_ranks

CPU = torch.device("cpu")
WORLD = 2
STEPS = 28  # `balanced` skips on the tiny DiT at 28 steps, not at 8
SPAWN_TIMEOUT_S = 240.0
# Short enough that a rank left waiting in a collective fails the test well inside the deadline.
GROUP_TIMEOUT = timedelta(seconds=60)
TOLERANCE = 1  # levels of 255
HEAD_HOOK = "fbc_leader_block_hook"  # diffusers' name for the First Block Cache head hook

REQUEST = GenerationRequest(
    request_id="r",
    pipeline="tiny-dit",
    prompt="a red cat",
    width=64,  # 16 image tokens, 32 text tokens: both divide by 2 ranks
    height=64,
    steps=STEPS,
    seed=7,
    guidance_scale=5.0,
    extra_inputs={"max_sequence_length": 32},
)
# Two requests: 2 rows per denoiser call, which `auto` splits one per rank (no context parallel).
ROW_SPLIT = [REQUEST, replace(REQUEST, request_id="s", seed=8)]


def _noop(step: int, total: int) -> None:
    pass


class SliceChanges:
    """Each call's change of the head block's residual as this rank measures it, on its slice.

    Read from the cache's own state after the head block ran: with a zero threshold every call
    computes, so the state holds this call's residual and the previous call's was kept here.
    """

    def __init__(self, pipeline: DiffusersPipeline) -> None:
        denoiser = pipeline.denoiser()
        assert denoiser is not None
        self.changes: list[float] = []
        self._previous: torch.Tensor | None = None
        cache_blocks(denoiser)[0].register_forward_hook(self._after_head)

    def _after_head(self, head: torch.nn.Module, _args: Any, _output: Any) -> None:
        registry: Any = getattr(head, "_diffusers_hook", None)
        hook = registry.get_hook(HEAD_HOOK) if registry is not None else None
        if hook is None:  # `exact`: no cache, nothing to measure
            return
        residual = hook.state_manager.get_state().head_block_residual.clone()
        if self._previous is not None:
            change = (residual - self._previous).abs().mean() / self._previous.abs().mean()
            self.changes.append(float(change))
        self._previous = residual


def splitting_threshold(per_rank: list[list[float]]) -> tuple[float, int]:
    """A threshold one rank's slice is under and another's over at some call; and that call.

    Every rank computes every call before it (all changes above the threshold), so the state at
    that call is the zero-threshold run's, where the changes were measured.
    """
    computed_before = float("inf")  # the smallest change of any rank at the earlier calls
    for call, changes in enumerate(zip(*per_rank, strict=True)):
        low, high = min(changes), min(max(changes), computed_before)
        if low < high:
            return (low + high) / 2, call
        computed_before = min(computed_before, low)
    raise AssertionError(f"no call where the ranks' slices straddle a threshold: {per_rank}")


def _run(pipeline: DiffusersPipeline, requests: list[GenerationRequest]) -> dict[str, Any]:
    counters = denoiser_counters(pipeline)
    assert counters is not None
    counters.reset()
    outputs = pipeline.run(requests, _noop)
    report = pipeline.last_speed
    assert report is not None
    return {
        "frames": np.stack([array for per_request in outputs for array in per_request]),
        "block_calls": report.block_calls,
        "skipped": report.block_calls_skipped,
        "calls": counters.calls,
        "context_calls": counters.context_calls,
    }


def _rank_main(rank: int, port: int, cache: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=GROUP_TIMEOUT,
    )
    try:
        settings = GpuWorkerSettings(model_cache=Path(cache))
        pipeline = load_pipeline("tiny-dit", CPU, settings)
        assert isinstance(pipeline, DiffusersPipeline)
        apply_parallel(pipeline, ParallelSpec("context"))
        # 1. What each rank's slice changes per call, nothing skipped.
        probe = SliceChanges(pipeline)
        pipeline.speed_thresholds["fast"] = 0.0
        pipeline.run([replace(REQUEST, speed="fast")], _noop)
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, probe.changes)
        threshold, call = splitting_threshold(gathered)
        # 2. The faster modes, context parallel.
        runs: dict[str, dict[str, Any]] = {}
        pipeline.speed_thresholds["fast"] = threshold
        runs["split_threshold"] = _run(pipeline, [replace(REQUEST, speed="fast")])
        runs["balanced"] = _run(pipeline, [replace(REQUEST, speed="balanced")])
        # 3. `auto` splitting the rows of two requests: each rank decides for its own row.
        rows = load_pipeline("tiny-dit", CPU, settings)
        assert isinstance(rows, DiffusersPipeline)
        apply_parallel(rows, ParallelSpec("auto"))
        rows.speed_thresholds["fast"] = threshold
        runs["row_split"] = _run(rows, [replace(r, speed="fast") for r in ROW_SPLIT])
        np.savez(Path(out_dir) / f"rank{rank}.npz", **{k: v["frames"] for k, v in runs.items()})
        report = {
            "changes": gathered,
            "threshold": threshold,
            "call": call,
            "runs": {k: {f: x for f, x in v.items() if f != "frames"} for k, v in runs.items()},
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_group(cache: Path, out_dir: Path) -> None:
    run_served_ranks(_rank_main, (_free_port(), str(cache), str(out_dir)), WORLD, SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def group_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 2-rank run, then the same requests on one rank here, at the ranks' threshold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = tmp_path_factory.mktemp("models")
        out_dir = tmp_path_factory.mktemp("ranks")
        settings = GpuWorkerSettings(model_cache=cache)
        whole = load_pipeline("tiny-dit", CPU, settings)  # builds the cache before the ranks
        assert isinstance(whole, DiffusersPipeline)
        apply_parallel(whole, ParallelSpec("none"))
        _run_group(cache, out_dir)
        reports = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
        whole.speed_thresholds["fast"] = reports[0]["threshold"]
        reference = {
            "split_threshold": _run(whole, [replace(REQUEST, speed="fast")]),
            "balanced": _run(whole, [replace(REQUEST, speed="balanced")]),
            "row_split": _run(whole, [replace(r, speed="fast") for r in ROW_SPLIT]),
        }
    finally:
        torch.set_num_threads(threads)
    ranks = [dict(np.load(out_dir / f"rank{rank}.npz")) for rank in range(WORLD)]
    return {"reference": reference, "ranks": ranks, "reports": reports}


def _max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def test_the_threshold_splits_the_slices(group_run: dict[str, Any]) -> None:
    # The premise: decided on its own slice, one rank would skip this call and the other not.
    report = group_run["reports"][0]
    changes = [rank_changes[report["call"]] for rank_changes in report["changes"]]
    assert min(changes) < report["threshold"] < max(changes)
    assert len(report["changes"][0]) == STEPS - 1  # every call after the first compared


@pytest.mark.parametrize("case", ["split_threshold", "balanced"])
def test_context_parallel_ranks_skip_alike_and_as_one_rank_does(
    group_run: dict[str, Any], case: str
) -> None:
    reference = group_run["reference"][case]
    runs = [report["runs"][case] for report in group_run["reports"]]
    for run in runs:
        assert run["context_calls"] == run["calls"] == STEPS  # it really ran context parallel
        assert run["block_calls"] == reference["block_calls"]
        assert run["skipped"] == reference["skipped"]  # the whole sequence's decision
    assert reference["skipped"] > 0
    rank0, rank1 = (frames[case] for frames in group_run["ranks"])
    assert np.array_equal(rank0, rank1)
    assert _max_diff(rank0, reference["frames"]) <= TOLERANCE


def test_a_row_split_forward_needs_no_agreement(group_run: dict[str, Any]) -> None:
    # No collective inside the blocks: each rank decides for its row, and the all-gather after
    # the forward hands both ranks the same prediction, so they step identically.
    runs = [report["runs"]["row_split"] for report in group_run["reports"]]
    assert [run["context_calls"] for run in runs] == [0, 0]
    assert all(run["skipped"] > 0 for run in runs)
    rank0, rank1 = (frames["row_split"] for frames in group_run["ranks"])
    assert np.array_equal(rank0, rank1)
    assert rank0.shape == group_run["reference"]["row_split"]["frames"].shape
    # Rank 0's row is decided as that request alone on one rank decides it.
    alone = group_run["reference"]["split_threshold"]["frames"]
    assert _max_diff(rank0[:1], alone) <= TOLERANCE
