"""The busy ratio of two nodes fed by a batch, side by side with the jobs submitted one by one.

Run: `.venv/bin/python tests/benchmarks/bench_batch_busy.py [--jobs 400] [--sleep 0.2]
[--rounds 3] [--env NAME=VALUE ...] [--modes batch,one-by-one]`.

Two `kiln worker` nodes serve the `busy` fixture pipeline (it sleeps `--sleep` s per request of a
forward and records each forward's start and end, per node here). Each round runs, in alternating
order, the same `--jobs` jobs fed as one batch (`kiln batch submit --wait`) and submitted one by
one up front (the baseline), each on a fresh private Redis and fresh nodes.

Per run:
- raw: forward time summed over both nodes / (2 × wall from the first forward's start to the
  last one's end), as bench_batches.py counts it: the nodes' warm-up forwards at start-up count,
  so the wall also holds the time until the first job exists (for a batch: the CLI starting,
  validating and storing the file, then the feeder's first pass) and the nodes' start-up skew;
- busy: the same over the jobs' forwards only (from the first job's forward start);
- lag: from the moment the jobs are handed over (CLI started / first submit) to the first job's
  forward start; pickup: of that, for the batch, from the batch existing to its first jobs fed
  (the feeder's first pass);
- steady: the same within the span where both nodes had work to do (from the later node's first
  forward start to the earlier node's last forward end): ramp-up and tail left out;
- per/fwd: mean requests per forward (the fixture's time is per request, so this moves the ratio
  only through the per-forward overhead);
- gap: mean and longest idle time between a node's forwards (steady span);
- dry: share of the steady span's samples (every 20 ms) in which the pipeline's queues in the
  broker held no message: a node that finished a forward then found nothing to take.

`--env` sets settings for both modes (e.g. `KILN_BATCH_RESULTS_FLUSH_S=0.2`). Needs
`redis-server` on PATH; everything runs in a temporary folder deleted at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.bench_batches import (  # noqa: E402
    BUSY_SPEC,
    LINE,
    base_env,
    start_redis,
)
from tests.e2e.cluster import Cluster  # noqa: E402

MODES = ("batch", "one-by-one")
SAMPLE_S = 0.02
QUEUES = ("interactive.busy", "bulk.busy")


@dataclass(frozen=True)
class Run:
    """What one run measured."""

    raw: float
    busy: float
    steady: float
    lag_s: float
    pickup_s: float  # batch: from the batch existing to its first jobs being fed (else 0)
    per_forward: float
    gap_mean_s: float
    gap_max_s: float
    dry: float


Forward = tuple[float, float, int]


def forwards_of(path: Path) -> list[Forward]:
    """The (start, end, requests) of a node's forwards, by start."""
    if not path.exists():
        return []
    rows = [row.split() for row in path.read_text().splitlines() if row.strip()]
    return sorted((float(a), float(b), int(n)) for a, b, n in rows)


def ratio(spans: list[Forward], nodes: int) -> float:
    """Forward time / (nodes × wall from the first start to the last end)."""
    busy_s = sum(end - start for start, end, _ in spans)
    wall = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    return busy_s / (nodes * wall)


def measure(
    nodes: list[list[Forward]],
    submitted_at: float,
    pickup_s: float,
    samples: list[tuple[float, int]],
) -> Run:
    """The figures of one run from each node's forwards and the broker samples.

    A node's warm-up forward (at start-up, before anything was submitted) is not a job's: `raw`
    counts it (as bench_batches.py does), every other figure leaves it out.
    """
    raw = ratio([f for node in nodes for f in node], len(nodes))
    nodes = [[f for f in node if f[0] >= submitted_at] for node in nodes]
    spans = [f for node in nodes for f in node]
    lo = max(node[0][0] for node in nodes)
    hi = min(node[-1][1] for node in nodes)
    inside = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end, _ in spans)
    gaps = [
        later[0] - earlier[1]
        for node in nodes
        for earlier, later in itertools.pairwise(node)
        if earlier[1] >= lo and later[0] <= hi
    ]
    steady_samples = [depth for at, depth in samples if lo <= at <= hi]
    return Run(
        raw=raw,
        busy=ratio(spans, len(nodes)),
        steady=inside / (len(nodes) * (hi - lo)) if hi > lo else float("nan"),
        lag_s=min(start for start, _, _ in spans) - submitted_at,
        pickup_s=pickup_s,
        per_forward=sum(n for _, _, n in spans) / len(spans),
        gap_mean_s=statistics.fmean(gaps) if gaps else 0.0,
        gap_max_s=max(gaps, default=0.0),
        dry=(
            sum(1 for depth in steady_samples if depth == 0) / len(steady_samples)
            if steady_samples
            else float("nan")
        ),
    )


def sample_broker(
    redis_url: str, prefix: str, stop: threading.Event, into: list[tuple[float, int]]
) -> None:
    """Every SAMPLE_S: (time, messages waiting in the pipeline's queues)."""
    client = redis.Redis.from_url(redis_url)
    keys = [f"{prefix}:celery:{queue}" for queue in QUEUES]
    while not stop.wait(SAMPLE_S):
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.llen(key)
        into.append((time.time(), sum(pipe.execute())))


def one_run(mode: str, jobs: int, sleep_s: float, extra: dict[str, str], folder: Path) -> Run:
    """Start a private Redis and two nodes, run the jobs in `mode`, measure."""
    server, redis_url = start_redis(folder)
    run = folder / f"{mode}-{time.monotonic_ns()}"
    run.mkdir()
    env = {
        **base_env(redis_url, run),
        "KILN_TEST_COMPLETIONS": str(run / "completions.log"),
        "KILN_BENCH_SLEEP_S": str(sleep_s),
        "KILN_BATCH_FEED_INTERVAL_S": "0.1",
        **extra,
    }
    cluster = Cluster(env=env, tmp=run)
    paths = [run / f"forwards-{n}.txt" for n in range(2)]
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        for path in paths:
            cluster.start_worker(
                f"busy={BUSY_SPEC}", wait=False, extra_env={"KILN_BENCH_FORWARDS": str(path)}
            )
        for worker in cluster.workers:
            worker.wait_ready()
        sampler = threading.Thread(
            target=sample_broker,
            args=(redis_url, env["KILN_REDIS_NAMESPACE"], stop, samples),
            daemon=True,
        )
        sampler.start()
        submitted_at = time.time()
        pickup_s = submit(cluster, mode, jobs, run)
    finally:
        stop.set()
        cluster.stop_all()
        server.terminate()
        server.wait(10)
    return measure([forwards_of(path) for path in paths], submitted_at, pickup_s, samples)


def submit(cluster: Cluster, mode: str, jobs: int, run: Path) -> float:
    """Run the jobs as one batch, or one by one up front; wait for all; the feeder's pickup."""
    lines = [{**LINE, "seed": n, "custom_id": f"b{n:05d}"} for n in range(jobs)]
    if mode == "batch":
        path = run / "batch.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        answer = cluster.run_cli(
            "batch", "submit", str(path), "--pipeline", "busy", "--wait", "--json", timeout_s=3600
        )
        assert answer.returncode == 0, answer.stderr
        view = json.loads(answer.stdout)
        return float(view["started_at"]) - float(view["created_at"])
    ids = [
        cluster.submit(pipeline="busy", **{k: v for k, v in line.items() if k != "custom_id"})
        for line in lines
    ]
    for job_id in ids:
        cluster.wait_for(job_id, timeout_s=3600)
    return 0.0


def show(mode: str, runs: list[Run]) -> str:
    """One line: each figure's median and its range over the rounds."""

    def spread(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}..{max(values):{fmt}}]"

    return (
        f"{mode:<10} raw {spread([r.raw for r in runs], '6.1%')}  "
        f"busy {spread([r.busy for r in runs], '6.1%')}  "
        f"lag {spread([r.lag_s * 1000 for r in runs], '5.0f')} ms "
        f"(pickup {spread([r.pickup_s * 1000 for r in runs], '4.0f')} ms)  "
        f"steady {spread([r.steady for r in runs], '6.1%')}  "
        f"per/fwd {spread([r.per_forward for r in runs], '4.2f')}  "
        f"gap {spread([r.gap_mean_s * 1000 for r in runs], '5.0f')} ms "
        f"max {spread([r.gap_max_s * 1000 for r in runs], '5.0f')} ms  "
        f"dry {spread([r.dry for r in runs], '6.1%')}"
    )


def main() -> None:
    """Run the rounds (modes alternating first), print each run and the medians."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--sleep", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for both modes")
    args = parser.parse_args()
    extra = dict(item.split("=", 1) for item in args.env)
    modes = args.modes.split(",")
    print(f"{os.cpu_count()} CPUs (shared); {args.jobs} jobs × {args.sleep} s, 2 nodes; {extra}")
    results: dict[str, list[Run]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-busy-") as tmp:
        for round_ in range(args.rounds):
            order = modes if round_ % 2 == 0 else modes[::-1]
            for mode in order:
                result = one_run(mode, args.jobs, args.sleep, extra, Path(tmp))
                results[mode].append(result)
                print(f"round {round_ + 1}: {show(mode, [result])}", flush=True)
    for mode in modes:
        print(f"median: {show(mode, results[mode])}")


if __name__ == "__main__":
    main()
