"""Dispatch overhead of the worker group, and the gain of batching (a script, not a test).

    .venv/bin/python -m tests.benchmarks.bench_dispatch [--requests 300] [--batching]

1. Round trip of a no-op request: `Coordinator.submit` -> rank 0 -> broadcast to every rank ->
   one step (StepDone, StopVerdict, the stop-decision broadcast) -> outcome gather -> frames
   through shared memory -> the future resolves. 1 and 2 CPU ranks, p50/p95, next to a direct
   in-process call of the same no-op pipeline as the baseline.
2. (--batching) 4 compatible tiny-pipeline requests in one forward vs 4 forwards, 1 CPU rank.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.protocol import GenerationRequest
from tests.gpu_worker.fixtures import noop, spec

TIMEOUT_S = 120.0


def percentiles(samples_s: list[float]) -> str:
    """'p50 … ms  p95 … ms  mean … ms' of samples in seconds."""
    ordered = sorted(samples_s)
    p50 = statistics.median(ordered) * 1000
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))] * 1000
    mean = statistics.fmean(ordered) * 1000
    return f"p50 {p50:7.3f} ms   p95 {p95:7.3f} ms   mean {mean:7.3f} ms"


def timed(call: Callable[[], object], repeats: int, warmup: int = 20) -> list[float]:
    """Wall time of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def noop_request(index: int, steps: int) -> GenerationRequest:
    """A request for the no-op fixture pipeline."""
    return GenerationRequest(
        f"noop-{index}", "noop", "x", 8, 8, steps, seed=index, guidance_scale=5.0
    )


def bench_in_process(repeats: int, steps: int) -> list[float]:
    """The baseline: the no-op pipeline called directly, no group, no processes."""
    pipeline = noop.make(torch.device("cpu"))
    request = noop_request(0, steps)
    return timed(lambda: pipeline.run([request], lambda _step, _total: None), repeats)


def bench_group(ranks: int, repeats: int, steps: int, window_s: float) -> list[float]:
    """Round trips through a coordinator with `ranks` CPU ranks, one request at a time."""
    config = GroupConfig(
        devices=[f"cpu:{ranks}"],
        pipelines={"noop": spec("noop")},
        cpu_threads_per_rank=1,
        batch_window_s=window_s,
    )
    coordinator = Coordinator(config)
    coordinator.start()
    counter = iter(range(10**9))
    try:
        return timed(
            lambda: coordinator.submit(noop_request(next(counter), steps)).result(TIMEOUT_S),
            repeats,
        )
    finally:
        coordinator.shutdown()


def four_compatible(coordinator: Coordinator, ids: Iterator[int]) -> None:
    """Submit 4 compatible tiny requests at once and wait for all of them."""
    futures = [
        coordinator.submit(
            GenerationRequest(
                f"t-{next(ids)}", "tiny", "a kiln", 64, 64, 4, seed=s, guidance_scale=5.0
            )
        )
        for s in range(4)
    ]
    for future in futures:
        future.result(TIMEOUT_S)


def bench_batching(repeats: int) -> None:
    """4 compatible tiny requests: one forward (batched) vs four forwards (max_batch=1)."""
    for max_batch in (1, 4):
        config = GroupConfig(
            devices=["cpu:1"],
            pipelines={"tiny": "tiny"},
            max_batch=max_batch,
            cpu_threads_per_rank=1,
        )
        coordinator = Coordinator(config)
        coordinator.start()
        ids = itertools.count()
        try:
            samples = timed(functools.partial(four_compatible, coordinator, ids), repeats, 2)
        finally:
            coordinator.shutdown()
        label = "4 forwards (max_batch=1)" if max_batch == 1 else "1 forward  (max_batch=4)"
        rate = 4 / statistics.median(samples)
        print(
            f"  tiny 64x64, 4 steps, 4 requests, {label}: {percentiles(samples)}  "
            f"{rate:6.1f} images/s"
        )


def main() -> None:
    """Run the benchmarks and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 10])
    parser.add_argument(
        "--windows",
        type=float,
        nargs="+",
        default=[0.0, 0.01],
        help="batch_window_s values (a lone request waits this long for company)",
    )
    parser.add_argument("--batching", action="store_true", help="also the tiny batching gain")
    args = parser.parse_args()
    print(f"no-op round trip, {args.requests} sequential requests each")
    for steps in args.steps:
        print(f"  steps={steps}")
        print(
            f"    in-process call (baseline): {percentiles(bench_in_process(args.requests, steps))}"
        )
        for window_s in args.windows:
            for ranks in (1, 2):
                samples = bench_group(ranks, args.requests, steps, window_s)
                label = f"coordinator, {ranks} CPU rank(s), window {window_s * 1000:g} ms"
                print(f"    {label}: {percentiles(samples)}")
    if args.batching:
        print("batching gain")
        bench_batching(repeats=10)


if __name__ == "__main__":
    main()
