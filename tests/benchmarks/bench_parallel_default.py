"""One job on `cpu:1` vs `cpu:2`, both with the default parallelism (`auto`), through a coordinator.

Run: `.venv/bin/python tests/benchmarks/bench_parallel_default.py [--size 256] [--outputs 2]
[--steps 25] [--repeats 5] [--none]`. Each group is started with default options (CPU threads:
the cores shared among the ranks) and warmed up with the measured request; the groups then take
turns, `--repeats` times. Prints each group's median wall time (submit to result). `--none` adds
cpu:2 with mode `none`, the old default, which every rank computes in full.
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
from kiln.gpu_worker.parallel import ParallelSpec
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings

TIMEOUT_S = 600.0


def _request(args: argparse.Namespace, index: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"bench-{index}", pipeline="tiny", prompt="a lighthouse at sunset",
        width=args.size, height=args.size, steps=args.steps, seed=7,
        num_outputs=args.outputs, guidance_scale=5.0,
    )  # fmt: skip


def _group(devices: str, cache: Path, force_none: bool = False) -> Coordinator:
    config = GroupConfig(
        devices=[devices], pipelines={"tiny": "tiny"}, settings=GpuWorkerSettings(model_cache=cache)
    )
    if force_none:
        # The mode GroupConfig now refuses on several ranks, forced past its check, to show what
        # the old default cost.
        object.__setattr__(config, "parallel", ParallelSpec("none"))
    coordinator = Coordinator(config)
    coordinator.start()
    return coordinator


def _timed(coordinator: Coordinator, request: GenerationRequest) -> float:
    started = time.perf_counter()
    coordinator.submit(request).result(TIMEOUT_S)
    return time.perf_counter() - started


def main() -> None:
    """Parse arguments, measure both groups, print."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--none", action="store_true", help="also time cpu:2 with mode none")
    args = parser.parse_args()
    cache = Path(os.environ.get("KILN_MODEL_CACHE") or tempfile.mkdtemp(prefix="kiln-bench-"))
    print(
        f"tiny {args.size}x{args.size} outputs={args.outputs} steps={args.steps} "
        f"repeats={args.repeats} cores={os.cpu_count()}",
        flush=True,
    )
    labels = ["cpu:1 auto", "cpu:2 auto"] + (["cpu:2 none (old default)"] if args.none else [])
    groups = {label: _group(label.split()[0], cache, "none" in label) for label in labels}
    times: dict[str, list[float]] = {label: [] for label in labels}
    try:
        for coordinator in groups.values():
            _timed(coordinator, _request(args, -1))  # warm this shape
        # Round-robin, so load from elsewhere on the machine falls on every group alike.
        for index in range(args.repeats):
            for label, coordinator in groups.items():
                times[label].append(_timed(coordinator, _request(args, index)))
    finally:
        for coordinator in groups.values():
            coordinator.shutdown()
    for label in labels:
        runs = ", ".join(f"{t:.2f}" for t in times[label])
        print(f"{label:<26} median {statistics.median(times[label]):6.2f} s  runs [{runs}]")


if __name__ == "__main__":
    main()
