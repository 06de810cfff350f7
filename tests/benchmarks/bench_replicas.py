"""`cpu:2` as one group of 2 ranks vs two replica groups of 1 rank, on a stream of tiny jobs.

Run: `.venv/bin/python tests/benchmarks/bench_replicas.py [--jobs 32] [--size 128] [--steps 10]
[--max-batch 4] [--rounds 2]`. Both layouts are started once, side by side, with the node's
defaults (parallel `auto`: the 2-rank group splits each forward's rows; CPU threads: the cores
shared among all ranks), and warmed up. Then, `--rounds` times and in turn, each layout gets the
whole stream at once (every job submitted at t=0, as a queue backlog reaches a node) and its
throughput is timed from the first submit to the last result. Idle ranks of the layout not being
measured wait on a pipe and use no CPU. Prints jobs/s per round and the median of each layout,
for the stream as submitted (`--max-batch`) and for the same stream with batching off (1), and
the median time of one job submitted alone to an idle layout (latency, not throughput).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.replicas import Replicas, node_coordinator
from kiln.gpu_worker.settings import GpuWorkerSettings

TIMEOUT_S = 1800.0
LAYOUTS = {"1 group x 2 ranks": None, "2 groups x 1 rank": 1}


def _requests(args: argparse.Namespace, label: str, round_index: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"{label}-{round_index}-{index}",
            pipeline="tiny",
            prompt=f"a lighthouse at sunset, take {index}",
            width=args.size,
            height=args.size,
            steps=args.steps,
            seed=index,
            guidance_scale=5.0,
        )
        for index in range(args.jobs)
    ]


def _layout(group_size: int | None, max_batch: int, cache: Path) -> Coordinator | Replicas:
    config = GroupConfig(
        devices=["cpu:2"],
        pipelines={"tiny": "tiny"},
        max_batch=max_batch,
        node_name=f"bench{group_size or 2}",
        settings=GpuWorkerSettings(model_cache=cache),
    )
    layout = node_coordinator(config, group_size)
    layout.start()
    return layout


def _stream(layout: Coordinator | Replicas, requests: list[GenerationRequest]) -> float:
    """Jobs per second for the whole stream, submitted at once."""
    started = time.perf_counter()
    futures = [layout.submit(request) for request in requests]
    for future in futures:
        future.result(TIMEOUT_S)
    return len(requests) / (time.perf_counter() - started)


def _lone(layout: Coordinator | Replicas, requests: list[GenerationRequest]) -> float:
    """Median seconds of one job submitted alone, on an idle layout."""
    times = []
    for request in requests:
        started = time.perf_counter()
        layout.submit(request).result(TIMEOUT_S)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _measure(
    args: argparse.Namespace, max_batch: int, cache: Path, latency: dict[str, float]
) -> dict[str, list[float]]:
    layouts = {label: _layout(size, max_batch, cache) for label, size in LAYOUTS.items()}
    rates: dict[str, list[float]] = {label: [] for label in layouts}
    try:
        for label, layout in layouts.items():  # warm-up: this shape, a full batch
            _stream(layout, _requests(args, f"warm-{label}", 0)[: 2 * max_batch])
        for round_index in range(args.rounds):
            for label, layout in layouts.items():
                rate = _stream(layout, _requests(args, label, round_index))
                rates[label].append(rate)
                print(f"  max_batch={max_batch} round {round_index + 1} {label}: {rate:.2f} jobs/s",
                      flush=True)  # fmt: skip
        if not latency:
            for label, layout in layouts.items():
                latency[label] = _lone(layout, _requests(args, f"lone-{label}", 0)[:5])
    finally:
        for layout in layouts.values():
            layout.shutdown()
    return rates


def main() -> None:
    """Parse arguments, measure both layouts with and without batching, print a table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cache = Path(os.environ.get("KILN_MODEL_CACHE") or tempfile.mkdtemp(prefix="kiln-bench-"))
    print(
        f"tiny {args.size}x{args.size} steps={args.steps} jobs={args.jobs} rounds={args.rounds} "
        f"cores={len(os.sched_getaffinity(0))}",
        flush=True,
    )
    table: dict[int, dict[str, list[float]]] = {}
    latency: dict[str, float] = {}
    for max_batch in dict.fromkeys((args.max_batch, 1)):
        table[max_batch] = _measure(args, max_batch, cache, latency)
    header = " ".join(f"{f'max_batch={b}':>14}" for b in table)
    print(f"\n{'layout':<20} {header} {'one job alone':>14}")
    for label in LAYOUTS:
        cells = " ".join(f"{statistics.median(table[b][label]):>10.2f} j/s" for b in table)
        print(f"{label:<20} {cells} {latency[label]:>12.3f} s")


if __name__ == "__main__":
    main()
