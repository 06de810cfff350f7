"""Batching gain: 4 compatible requests in one forward vs the same 4 in 4 forwards.

Run: `.venv/bin/python tests/benchmarks/bench_batching.py [--pipeline tiny] [--repeats 9]`.
Same process, same loaded pipeline, warm; prints the median of each and their ratio.
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

import torch

from kiln.gpu_worker.pipelines import Pipeline, load_pipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings


def _noop(step: int, total: int) -> None:
    pass


def _timed(pipeline: Pipeline, batches: list[list[GenerationRequest]]) -> float:
    start = time.perf_counter()
    for batch in batches:
        pipeline.run(batch, _noop)
    return time.perf_counter() - start


def main() -> None:
    """Parse arguments, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pipeline", default="tiny", help="tiny | tiny-video | diffusers:<path>")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = Path(os.environ.get("KILN_MODEL_CACHE") or tempfile.mkdtemp(prefix="kiln-bench-"))
    pipeline = load_pipeline(
        args.pipeline, torch.device("cpu"), GpuWorkerSettings(model_cache=cache)
    )
    base = GenerationRequest(
        request_id="bench", pipeline=args.pipeline, prompt="a lighthouse at sunset",
        width=args.size, height=args.size, steps=args.steps, seed=0, num_frames=args.frames,
        guidance_scale=5.0,
    )  # fmt: skip
    requests = [replace(base, request_id=f"r{i}", seed=i) for i in range(args.requests)]
    together, apart = [requests], [[request] for request in requests]
    _timed(pipeline, together + apart)  # warm up both shapes
    one_forward, many_forwards = [], []
    for _ in range(args.repeats):
        one_forward.append(_timed(pipeline, together))
        many_forwards.append(_timed(pipeline, apart))
    batched = statistics.median(one_forward)
    separate = statistics.median(many_forwards)
    print(
        f"{args.pipeline} {args.size}x{args.size} frames={args.frames} steps={args.steps} "
        f"threads={torch.get_num_threads()} repeats={args.repeats}"
    )
    print(f"{args.requests} requests in 1 forward : median {batched * 1000:8.1f} ms")
    print(f"{args.requests} requests in {args.requests} forwards: median {separate * 1000:8.1f} ms")
    print(f"batching gain: {separate / batched:.2f}x")


if __name__ == "__main__":
    main()
