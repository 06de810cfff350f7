"""Sleep/wake and torch.compile, measured side by side in one run; CPU ranks or one CUDA device.

Run: `.venv/bin/python tests/benchmarks/bench_sleep_compile.py [--device cpu|cuda:0]
[--pipeline tiny] [--size 64] [--steps 4] [--rounds 3] [--jobs 5] [--skip-sleep]
[--skip-compile]`.

(a) Sleep, for each mode (`offload`, `drop`): one group with `idle_sleep_s`; each round waits
until the group sleeps, then times a job that wakes it (submit to result, and the `wake_s` in its
metrics), then a job right after on the awake group. Memory is rank 0's own reading before the
sleep, once asleep and after the wake (the next sleep's "before"): RSS on CPU; on CUDA also
`torch.cuda.memory_allocated` / `memory_reserved`.

(b) Compile: time from `Coordinator.start()` until ready, with a warm-up of the benchmark's shape
(`WxHxSTEPS`), for eager, for `compile` with an empty cache folder (first start) and for
`compile` again on the now-populated folder (restart), each started while no other group works;
then the median per-job time (the forward on the ranks, `run_s`) of `--jobs` jobs each, eager and
compiled taken in turn (the group not running a job waits on a pipe, using no CPU), so both see
the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.protocol import GenerationRequest, GenerationResult
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.compile_reports import start_report

TIMEOUT_S = 1800.0
POLL_S = 0.02


def _group(args: argparse.Namespace, **settings: Any) -> tuple[Coordinator, float]:
    """A started group of one rank on the device; seconds its start took (load, warm-up)."""
    config = GroupConfig(
        devices=[args.device],
        pipelines={"bench": args.pipeline},
        node_name="bench",
        ready_timeout_s=TIMEOUT_S,  # a cold compile on a busy CPU can take minutes
        settings=GpuWorkerSettings(warmup=[f"{args.size}x{args.size}x{args.steps}"], **settings),
    )
    coordinator = Coordinator(config)
    started = time.perf_counter()
    coordinator.start()
    return coordinator, time.perf_counter() - started


def _job(coordinator: Coordinator, args: argparse.Namespace, label: str) -> tuple[float, Any]:
    """Submit one job of the benchmark's shape, wait; (seconds to its result, its metrics)."""
    request = GenerationRequest(
        request_id=label,
        pipeline="bench",
        prompt="a lighthouse at dusk",
        width=args.size,
        height=args.size,
        steps=args.steps,
        seed=1,
        guidance_scale=5.0,
    )
    started = time.perf_counter()
    result: GenerationResult = coordinator.submit(request).result(TIMEOUT_S)
    return time.perf_counter() - started, result.metrics


def _sleep_report(coordinator: Coordinator, sleeps: int) -> dict[str, Any]:
    """Wait for the group's `sleeps`-th sleep; rank 0's report of it."""
    while coordinator.stats()["sleeps"] < sleeps or not coordinator.stats()["last_sleep"]:
        time.sleep(POLL_S)
    while True:  # the report arrives a moment after the command left
        stats = coordinator.stats()
        report = stats["last_sleep"]
        if stats["asleep"] and report is not None:
            return dict(report)
        time.sleep(POLL_S)


def _memory(reading: dict[str, float], cuda: bool) -> str:
    text = f"rss {reading['rss_mb']:.0f}"
    if cuda:
        text += f", allocated {reading['allocated_mb']:.0f}, reserved {reading['reserved_mb']:.0f}"
    return text + " MiB"


def measure_sleep(args: argparse.Namespace, mode: str) -> None:
    """(a) for one mode: memory before / asleep / after wake; woken vs awake job latency."""
    coordinator, _ = _group(args, idle_sleep_s=args.idle_sleep_s, sleep_mode=mode)
    woken_s, wake_s, awake_s, reports = [], [], [], []
    try:
        for index in range(args.rounds):
            reports.append(_sleep_report(coordinator, index + 1))
            seconds, metrics = _job(coordinator, args, f"{mode}-woken-{index}")
            woken_s.append(seconds)
            wake_s.append(metrics.wake_s)
            awake_s.append(_job(coordinator, args, f"{mode}-awake-{index}")[0])
        reports.append(_sleep_report(coordinator, args.rounds + 1))
    finally:
        coordinator.shutdown()
    cuda = args.device.startswith("cuda")
    print(f"sleep mode {mode} ({args.rounds} rounds, medians; memory of the first round):")
    print(f"  before sleep:  {_memory(reports[0]['before'], cuda)}")
    print(f"  asleep:        {_memory(reports[0]['after'], cuda)}")
    print(f"  after wake:    {_memory(reports[1]['before'], cuda)}")
    print(f"  sleep took {statistics.median(r['sleep_s'] for r in reports):.3f} s")
    print(f"  job that wakes the group: {statistics.median(woken_s):.3f} s "
          f"(wake_s {statistics.median(wake_s):.3f} s)")  # fmt: skip
    print(f"  job on the awake group:   {statistics.median(awake_s):.3f} s", flush=True)


def _interleaved(groups: dict[str, Coordinator], args: argparse.Namespace) -> dict[str, float]:
    """Median forward time (`run_s`) per group, their `--jobs` jobs taken in turn."""
    forwards: dict[str, list[float]] = {label: [] for label in groups}
    for index in range(args.jobs):
        for label, coordinator in groups.items():
            forwards[label].append(_job(coordinator, args, f"{label}-{index}")[1].run_s)
    return {label: statistics.median(times) for label, times in forwards.items()}


def measure_compile(args: argparse.Namespace, cache: Path) -> None:
    """(b) start until ready: eager, compiled cold, compiled warm; per-job times side by side."""
    ready: dict[str, float] = {}
    groups: dict[str, Coordinator] = {}
    try:
        for label, compiled in (("eager", False), ("compile, empty cache", True)):
            groups[label], ready[label] = _group(args, compile=compiled, compile_cache_dir=cache)
            report = start_report(cache) if compiled else None
            print(f"  {label}: ready after {ready[label]:.2f} s; cache report {report}", flush=True)
        per_job = _interleaved(groups, args)  # the idle group waits on a pipe: no CPU
    finally:
        for coordinator in groups.values():
            coordinator.shutdown()
    restarted, ready["compile, restart"] = _group(args, compile=True, compile_cache_dir=cache)
    restarted.shutdown()
    print(f"  compile, restart: cache report {start_report(cache)}", flush=True)
    print("compile (start to ready, warm-up included):")
    for label, ready_s in ready.items():
        print(f"  {label:<22} {ready_s:7.2f} s  ({ready_s / ready['eager']:.2f}x eager)")
    eager_job, compiled_job = per_job["eager"], per_job["compile, empty cache"]
    ratio = compiled_job / eager_job
    print(f"  per job (forward, {args.jobs} each, interleaved): eager {eager_job * 1000:.1f} ms, "
          f"compiled {compiled_job * 1000:.1f} ms ({ratio:.2f}x)", flush=True)  # fmt: skip


def main() -> None:
    """Parse arguments; measure (a) sleep for both modes and (b) compile; print the figures."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu (one CPU rank) or cuda:N")
    parser.add_argument("--pipeline", default="tiny", help="a pipeline spec, as --pipeline takes")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--idle-sleep-s", type=float, default=0.5)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--skip-sleep", action="store_true")
    args = parser.parse_args()
    print(f"device {args.device}, pipeline {args.pipeline}, {args.size}x{args.size}, "
          f"{args.steps} steps", flush=True)  # fmt: skip
    for mode in () if args.skip_sleep else ("offload", "drop"):
        measure_sleep(args, mode)
    if not args.skip_compile:
        with tempfile.TemporaryDirectory(prefix="kiln-compile-") as folder:
            measure_compile(args, Path(folder))


if __name__ == "__main__":
    main()
