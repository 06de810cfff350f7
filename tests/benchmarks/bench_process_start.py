"""What a rank process costs to start: spawned (a fresh interpreter) or forked by the rank server.

    .venv/bin/python -m tests.benchmarks.bench_process_start [--start spawn,forkserver]
        [--repeats 3] [--only group,node]

The start method is the switch (`KILN_RANK_START`, gpu_worker/rank_server.py): the same code runs
with each, interleaved in one script run, because the machine is shared and noisy.

1. group: in a fresh process (a node process of its own, so the rank server starts cold), a
   2-rank CPU group serving the tiny pipeline: its first start (`Coordinator.start`: prepare,
   start the ranks, every rank ready; under forkserver this includes starting the server), a
   second group's start in the same process, and the replacement of a killed rank (SIGKILL to
   rank 1 -> the coordinator has rebuilt the group and it is ready).
2. node: a real `kiln worker` (1 CPU rank, tiny resident; Redis at KILN_TEST_REDIS_URL, a moto
   S3 in this process) started cold with a tiny job submitted at once: submit -> the job's first
   denoising step (its first `progress` event of stage denoising, Redis TIME).

Prints one line per sample and the median per method.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.e2e.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("spawn", "forkserver")
GROUP_FIGURES = ("first_start_s", "second_start_s", "replacement_s")
GENEROUS_S = 600.0


def group_child(method: str) -> None:
    """In this (fresh) process: time two group starts and one replacement; print JSON."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kiln.gpu_worker.config import GroupConfig
    from kiln.gpu_worker.coordinator import Coordinator
    from kiln.gpu_worker.settings import GpuWorkerSettings

    settings = GpuWorkerSettings(rank_start=method, cpu_threads_per_rank=1)  # type: ignore[arg-type]
    config = GroupConfig.from_settings(settings, ["cpu:2"], {"tiny": "tiny"})
    figures: dict[str, float] = {}
    started = time.monotonic()
    first = Coordinator(config)
    first.start()
    figures["first_start_s"] = time.monotonic() - started
    first.shutdown()
    started = time.monotonic()
    second = Coordinator(config)
    second.start()
    figures["second_start_s"] = time.monotonic() - started
    follower = second.stats()["pids"][1]
    started = time.monotonic()
    os.kill(follower, signal.SIGKILL)
    deadline = started + GENEROUS_S
    while True:
        stats = second.stats()
        if stats["rebuilds"] >= 1 and stats["group_alive"] and follower not in stats["pids"]:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rebuilt group after {GENEROUS_S:.0f} s: {stats}")
        time.sleep(0.01)
    figures["replacement_s"] = time.monotonic() - started
    second.shutdown()
    print(json.dumps(figures), flush=True)


def run_group(method: str) -> dict[str, float]:
    """One group sample in a fresh process (the rank server, if any, starts cold there)."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.benchmarks.bench_process_start", "--child", method],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=GENEROUS_S,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"group sample ({method}) failed:\n{result.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures


def seconds_to_first_step(cluster: Cluster, pipeline: str) -> float:
    """Submit a small job of `pipeline` now: seconds to its first denoising step (Redis TIME)."""
    from kiln.tasks.contract.schemas import JobRequest

    request = JobRequest(pipeline=pipeline, prompt="cold", width=64, height=64, steps=4, seed=1)
    submitted_at = time.time()
    record, _ = cluster.intake.submit(request)
    deadline, seq = time.monotonic() + GENEROUS_S, 0
    while time.monotonic() < deadline:
        for event in cluster.store.events(record.id, after_seq=seq, block_ms=2000):
            seq = event.seq
            if event.type == "progress" and event.payload.get("stage") == "denoising":
                return event.time - submitted_at
            if event.type in ("failed", "canceled", "expired"):
                raise RuntimeError(f"cold-start job ended {event.type}: {event.payload}")
    raise TimeoutError(f"no first step after {GENEROUS_S:.0f} s")


def run_node(method: str, tmp: Path, endpoint: str, redis_url: str) -> float:
    """A cold `kiln worker` with a tiny job submitted at once: seconds to its first step."""
    from tests.benchmarks.bench_node import Services

    os.environ["KILN_RANK_START"] = method  # the node's environment (Services copies it)
    found = Services(tmp, redis_url, endpoint, sleep_s=0.0, threads=1)
    try:
        found.start_node(max_batch=1)
        return seconds_to_first_step(found.nodes[1].cluster, "tiny")
    finally:
        found.stop()
        os.environ.pop("KILN_RANK_START", None)


def median_line(name: str, method: str, samples: list[float]) -> str:
    """`name method: median X s (samples a, b, c)`."""
    shown = ", ".join(f"{s:.2f}" for s in samples)
    return f"{name:<28} {method:<10}: median {statistics.median(samples):6.2f} s  ({shown})"


def bench_groups(methods: list[str], repeats: int) -> list[str]:
    """Interleaved group samples; the summary lines."""
    samples: dict[str, dict[str, list[float]]] = {
        m: {f: [] for f in GROUP_FIGURES} for m in methods
    }
    for repeat in range(repeats):
        for method in methods:
            figures = run_group(method)
            print(f"# group {repeat + 1}/{repeats} {method}: {json.dumps(figures)}", flush=True)
            for name in GROUP_FIGURES:
                samples[method][name].append(figures[name])
    labels = {
        "first_start_s": "group start (cold process)",
        "second_start_s": "group start (second)",
        "replacement_s": "killed rank -> rebuilt",
    }
    return [median_line(labels[f], m, samples[m][f]) for f in GROUP_FIGURES for m in methods]


def bench_nodes(methods: list[str], repeats: int) -> list[str]:
    """Interleaved cold-node samples (moto in this process); the summary lines."""
    import logging

    from moto.server import ThreadedMotoServer

    from tests.conftest import TEST_REDIS_URL

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    redis_url = TEST_REDIS_URL
    samples: dict[str, list[float]] = {m: [] for m in methods}
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-start-") as folder:
            for repeat in range(repeats):
                for method in methods:
                    tmp = Path(folder) / f"{method}-{repeat}"
                    tmp.mkdir()
                    seconds = run_node(method, tmp, f"http://{host}:{port}", redis_url)
                    print(f"# node {repeat + 1}/{repeats} {method}: {seconds:.2f} s", flush=True)
                    samples[method].append(seconds)
    finally:
        moto.stop()
    return [median_line("node: submit -> first step", m, samples[m]) for m in methods]


def main() -> None:
    """Parse the switches, run the chosen benchmarks, print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--start", default=",".join(METHODS), help="spawn,forkserver (either)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="group,node", help="group,node (either)")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        group_child(args.child)
        return
    methods = [m for m in args.start.split(",") if m]
    if unknown := [m for m in methods if m not in METHODS]:
        print(f"--start: unknown method {unknown[0]!r} (spawn, forkserver)", file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"# {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}", flush=True)
    lines: list[str] = []
    if "group" in args.only:
        lines += bench_groups(methods, args.repeats)
    if "node" in args.only:
        lines += bench_nodes(methods, args.repeats)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
