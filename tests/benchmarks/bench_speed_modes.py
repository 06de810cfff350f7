"""Wall time per speed mode on the tiny DiT pipelines, side by side in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python -m tests.benchmarks.bench_speed_modes [--rounds 5]

For each pipeline (`tiny-dit`, Flux-style; `tiny-video`, Wan-style) and each mode, the same
request (64x64, `--steps` steps, one fixed seed) runs through `DiffusersPipeline.run`, as a rank
runs it. Modes alternate within every round, so a load change on the machine hits them alike;
the median of the rounds is printed with its ratio to `exact`, the share of block calls skipped,
and the output's distance from `exact` (max and mean absolute difference, of 255).
`--max-sequence-length` shortens the T5 prompt of `tiny-dit` (its default 512 tokens dwarf a
4x4-latent image). Warm-up runs first, untimed. On CPU, and on a CUDA device with `--device`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from kiln.common.request import SPEED_MODES
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings


def no_progress(step: int, total: int) -> None:
    """A step callback that ignores the steps."""


def base_request(pipeline: str, steps: int, max_sequence_length: int) -> GenerationRequest:
    """The benchmark's request for `pipeline`: 64x64 (a 5-frame video for tiny-video)."""
    video = pipeline == "tiny-video"
    return GenerationRequest(
        request_id="bench",
        pipeline=pipeline,
        prompt="a red fox in the snow",
        width=64,
        height=64,
        steps=steps,
        seed=7,
        num_frames=5 if video else 1,
        guidance_scale=5.0,
        extra_inputs={} if video else {"max_sequence_length": max_sequence_length},
    )


def bench_pipeline(
    pipeline: DiffusersPipeline, request: GenerationRequest, rounds: int
) -> list[tuple[str, float, float, int, float]]:
    """Per mode: (mode, median seconds, skipped share, max diff, mean diff) against exact."""
    times: dict[str, list[float]] = {mode: [] for mode in SPEED_MODES}
    outputs: dict[str, np.ndarray] = {}
    skipped: dict[str, float] = {}
    for mode in SPEED_MODES:  # warm-up
        pipeline.run([replace(request, speed=mode)], no_progress)
    for _ in range(rounds):
        for mode in SPEED_MODES:
            started = time.perf_counter()
            [[frames]] = pipeline.run([replace(request, speed=mode)], no_progress)
            times[mode].append(time.perf_counter() - started)
            outputs[mode] = frames
            report = pipeline.last_speed
            calls = report.block_calls if report else 0
            skipped[mode] = (report.block_calls_skipped / calls) if report and calls else 0.0
    exact = outputs["exact"].astype(np.int16)
    rows = []
    for mode in SPEED_MODES:
        diff = np.abs(outputs[mode].astype(np.int16) - exact)
        rows.append(
            (mode, statistics.median(times[mode]), skipped[mode], int(diff.max()), diff.mean())
        )
    return rows


def main() -> None:
    """Run every mode of every tiny DiT pipeline and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pipelines", default="tiny-dit,tiny-video")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--max-sequence-length", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cache = Path(tempfile.mkdtemp(prefix="kiln-bench-speed-"))
    settings = GpuWorkerSettings(model_cache=cache)
    print(f"device {device}, {args.steps} steps, {args.rounds} rounds, torch {torch.__version__}")
    print("pipeline    mode      median_s  vs_exact  skipped  max_diff  mean_diff")
    for name in args.pipelines.split(","):
        pipeline = load_pipeline(name, device, settings)
        assert isinstance(pipeline, DiffusersPipeline)
        request = base_request(name, args.steps, args.max_sequence_length)
        rows = bench_pipeline(pipeline, request, args.rounds)
        exact_s = rows[0][1]
        for mode, median_s, share, max_diff, mean_diff in rows:
            print(
                f"{name:<11} {mode:<9} {median_s:8.3f}  {median_s / exact_s:7.2f}x "
                f"{share:7.0%}  {max_diff:8d}  {mean_diff:9.3f}"
            )


if __name__ == "__main__":
    main()
