"""Parallelism across real ranks: 2 from the rank server, gloo over 127.0.0.1, the tiny pipelines.

Each rank runs the image cases with an explicit batch split and with `auto` (the default), and the
video cases with explicit context parallel and with `auto`, counting what its denoiser computed.

Tolerance: a 2-rank output may differ from the 1-rank output by at most 1 level of 255 per pixel
(a slice of a batch and the whole batch go through differently blocked matmuls on CPU); the ranks
of one group agree with each other exactly.
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

from kiln.gpu_worker.parallel import (
    ContextKind,
    ParallelSpec,
    apply_parallel,
    denoiser_counters,
    split_sizes,
)
from kiln.gpu_worker.pipelines import Pipeline, load_pipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.conftest import run_served_ranks

CPU = torch.device("cpu")
WORLD = 2
SPAWN_TIMEOUT_S = 240.0
TOLERANCE = 1  # levels of 255

_BASE = GenerationRequest(
    request_id="r",
    pipeline="tiny",
    prompt="a red cat",
    width=64,
    height=64,
    steps=3,
    seed=5,
    guidance_scale=5.0,
)
# name -> (requests, denoiser rows per step with one rank)
IMAGE_CASES: dict[str, tuple[list[GenerationRequest], int]] = {
    "cfg_two_outputs": ([replace(_BASE, num_outputs=2)], 4),
    "two_requests": ([replace(_BASE, seed=1), replace(_BASE, request_id="s", seed=2)], 4),
    "uneven_rows": ([replace(_BASE, guidance_scale=1.0, num_outputs=3)], 3),
    "fewer_rows_than_ranks": ([replace(_BASE, guidance_scale=1.0)], 1),
}
VIDEO_REQUEST = replace(_BASE, pipeline="tiny-video", num_frames=5, steps=2)
# tiny-video (Wan) calls its transformer twice per step (conditional, unconditional), each with
# one row per output. How `auto` divides each call on 2 ranks:
AUTO_VIDEO_CASES: dict[str, GenerationRequest] = {
    "one_row": VIDEO_REQUEST,  # 1 row: context parallel (16 tokens per frame, 2 heads)
    "two_outputs": replace(VIDEO_REQUEST, num_outputs=2),  # 2 rows: one row per rank
    # 48x48, 1 frame: 9 tokens do not divide by 2 ranks, so rank 0 takes the row, rank 1 idles.
    "odd_sequence": replace(VIDEO_REQUEST, width=48, height=48, num_frames=1),
}


def _noop(step: int, total: int) -> None:
    pass


Frames = dict[str, np.ndarray]
Counts = dict[str, list[int]]


def _run_cases(
    pipeline: Pipeline, cases: dict[str, list[GenerationRequest]], prefix: str = ""
) -> tuple[Frames, Counts]:
    """Per case: every output stacked, and [calls, rows, idle_calls, context_calls]."""
    counters = denoiser_counters(pipeline)
    assert counters is not None
    frames: Frames = {}
    counts: Counts = {}
    for name, requests in cases.items():
        counters.reset()
        outputs = pipeline.run(requests, _noop)
        arrays = [array for per_request in outputs for array in per_request]
        frames[prefix + name] = np.stack(arrays)
        counts[prefix + name] = [
            counters.calls,
            counters.rows,
            counters.idle_calls,
            counters.context_calls,
        ]
    return frames, counts


def _image_cases() -> dict[str, list[GenerationRequest]]:
    return {name: requests for name, (requests, _) in IMAGE_CASES.items()}


def _video_cases() -> dict[str, list[GenerationRequest]]:
    return {name: [request] for name, request in AUTO_VIDEO_CASES.items()}


def _run_everything(settings: GpuWorkerSettings) -> tuple[Frames, Counts]:
    """On a rank: batch split and auto on the image cases, context and auto on the videos."""
    frames: Frames = {}
    counts: Counts = {}
    runs = [
        ("tiny", "batch", _image_cases(), ""),
        ("tiny", "auto", _image_cases(), "auto:"),
        ("tiny-video", "context", {"video": [VIDEO_REQUEST]}, ""),
        ("tiny-video", "auto", _video_cases(), "auto:video:"),
    ]
    for spec, mode, cases, prefix in runs:
        pipeline = load_pipeline(spec, CPU, settings)
        apply_parallel(pipeline, ParallelSpec(mode))  # type: ignore[arg-type]
        run_frames, run_counts = _run_cases(pipeline, cases, prefix)
        frames.update(run_frames)
        counts.update(run_counts)
    return frames, counts


def _rank_main(rank: int, port: int, cache: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    try:
        frames, counts = _run_everything(GpuWorkerSettings(model_cache=Path(cache)))
        arrays: dict[str, Any] = frames
        np.savez(Path(out_dir) / f"rank{rank}.npz", **arrays)
        report = {"counts": counts}
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
    """One 2-rank run of every scenario, plus the 1-rank references computed here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cache = tmp_path_factory.mktemp("models")
        out_dir = tmp_path_factory.mktemp("ranks")
        settings = GpuWorkerSettings(model_cache=cache)
        image = load_pipeline("tiny", CPU, settings)  # builds the cache before the ranks start
        apply_parallel(image, ParallelSpec("none"))
        reference, reference_counts = _run_cases(image, _image_cases())
        video = load_pipeline("tiny-video", CPU, settings)
        apply_parallel(video, ParallelSpec("none"))
        cases = {"video": [VIDEO_REQUEST], **_video_cases()}
        video_frames, video_counts = _run_cases(video, cases)
        reference.update(video_frames)
        reference_counts.update(video_counts)
        _run_group(cache, out_dir)
    finally:
        torch.set_num_threads(threads)
    ranks = [dict(np.load(out_dir / f"rank{rank}.npz")) for rank in range(WORLD)]
    reports = [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    return {
        "settings": settings,
        "reference": reference,
        "reference_counts": reference_counts,
        "ranks": ranks,
        "reports": reports,
    }


def _max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.mark.parametrize(
    ("case", "reference"),
    [
        *((name, name) for name in IMAGE_CASES),
        *((f"auto:{name}", name) for name in IMAGE_CASES),
        ("video", "video"),
        *((f"auto:video:{name}", name) for name in AUTO_VIDEO_CASES),
    ],
)
def test_two_ranks_match_one_rank(group_run: dict[str, Any], case: str, reference: str) -> None:
    rank0, rank1 = group_run["ranks"]
    assert np.array_equal(rank0[case], rank1[case])  # every rank stepped identically
    assert _max_diff(rank0[case], group_run["reference"][reference]) <= TOLERANCE


@pytest.mark.parametrize("mode", ["", "auto:"])
@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_batch_split_divides_the_rows(group_run: dict[str, Any], case: str, mode: str) -> None:
    # The tiny UNet has no context-parallel plan, so `auto` splits its rows like `batch`.
    requests, rows_per_step = IMAGE_CASES[case]
    steps = requests[0].steps
    assert group_run["reference_counts"][case] == [steps, steps * rows_per_step, 0, 0]
    expected_rows = split_sizes(rows_per_step, WORLD)
    for rank, report in enumerate(group_run["reports"]):
        calls, rows, idle, context = report["counts"][mode + case]
        assert (calls, rows, context) == (steps, steps * expected_rows[rank], 0)
        # A rank without a row sits the forward out instead of recomputing someone else's.
        assert idle == (steps if expected_rows[rank] == 0 else 0)


def test_cfg_halves_go_to_different_ranks(group_run: dict[str, Any]) -> None:
    counts = [report["counts"]["cfg_two_outputs"] for report in group_run["reports"]]
    assert [rows for _, rows, _, _ in counts] == [6, 6]  # 3 steps x (4 rows / 2 ranks)


def test_auto_divides_every_video_forward(group_run: dict[str, Any]) -> None:
    reference = group_run["reference_counts"]
    per_rank = [report["counts"] for report in group_run["reports"]]
    calls, rows = reference["one_row"][:2]
    # One row per call: both ranks work on it, each on half its sequence.
    assert [counts["auto:video:one_row"] for counts in per_rank] == [[calls, rows, 0, calls]] * 2
    # Two rows per call: one each, and together exactly the rows one rank computes.
    calls, rows = reference["two_outputs"][:2]
    two = [counts["auto:video:two_outputs"] for counts in per_rank]
    assert two == [[calls, rows // 2, 0, 0]] * 2
    # An odd sequence cannot be split: rank 0 computes the row once, rank 1 computes nothing.
    calls, rows = reference["odd_sequence"][:2]
    odd = [counts["auto:video:odd_sequence"] for counts in per_rank]
    assert odd == [[calls, rows, 0, 0], [calls, 0, calls, 0]]


@pytest.mark.parametrize(
    ("spec", "kind", "message"),
    [
        ("tiny", "ulysses", "UNet2DConditionModel has no context-parallel plan"),
        ("tiny", "ring", "UNet2DConditionModel has no context-parallel plan"),
        ("tiny-video", "ring", "ring attention does not run on CPU"),
    ],
)
def test_context_parallel_refusals_are_clear(
    group_run: dict[str, Any], spec: str, kind: ContextKind, message: str
) -> None:
    # Refused before any collective, so no process group is needed here.
    pipeline = load_pipeline(spec, CPU, group_run["settings"])
    with pytest.raises(ValueError, match=message):
        apply_parallel(pipeline, ParallelSpec("context", kind))


def test_parallel_needs_a_denoiser() -> None:
    class NoDenoiser:
        name = "none"

        def denoiser(self) -> None:
            return None

    apply_parallel(NoDenoiser(), ParallelSpec("none"))  # type: ignore[arg-type]
    apply_parallel(NoDenoiser(), ParallelSpec())  # type: ignore[arg-type]  # auto: nothing to do
    with pytest.raises(ValueError, match="no denoiser"):
        apply_parallel(NoDenoiser(), ParallelSpec("batch"))  # type: ignore[arg-type]


def test_parallel_spec_rejects_unknown_modes() -> None:
    with pytest.raises(ValueError, match=r"none\|batch\|context"):
        ParallelSpec("tensor")  # type: ignore[arg-type]


def test_split_sizes() -> None:
    assert split_sizes(4, 2) == [2, 2]
    assert split_sizes(3, 2) == [2, 1]
    assert split_sizes(1, 2) == [1, 0]
    assert split_sizes(5, 3) == [2, 2, 1]


def test_parallel_is_applied_once(group_run: dict[str, Any]) -> None:
    pipeline = load_pipeline("tiny", CPU, group_run["settings"])
    apply_parallel(pipeline, ParallelSpec("none"))
    with pytest.raises(RuntimeError, match="already applied"):
        apply_parallel(pipeline, ParallelSpec("none"))
