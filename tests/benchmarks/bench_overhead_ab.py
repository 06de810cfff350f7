"""Per-job overhead of two Kiln trees side by side: a base and a candidate (a script).

    git archive HEAD | tar -x -C /tmp/kiln-base
    .venv/bin/python tests/benchmarks/bench_overhead_ab.py /tmp/kiln-base [--rounds 4] [--jobs 30]

Starts one `kiln worker` from each tree (1 CPU rank, `tiny` as bench_node.py serves it, its own
namespace and bucket on the same Redis and moto S3), then sends tiny jobs (64x64, 4 steps, png)
one at a time, alternating which tree goes first, so a shared, noisy machine slows both alike.
Per job: overhead = submit -> terminal event seen (blocking XREAD) - rank 0's forward - encode_s
- upload_s (bench_node.py's "L - own compute"). Prints p50 / p90 per round and side, then all.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from kiln.tasks.contract.schemas import JobRequest  # noqa: E402
from tests.benchmarks.bench_node import TINY_SPEC, read_forwards, tiny_requests, wait_event  # noqa: E402
from tests.conftest import TEST_REDIS_URL, delete_namespace  # noqa: E402
from tests.e2e.cluster import Cluster, WorkerProcess  # noqa: E402

WARMUP_JOBS = 5


@dataclass
class Side:
    """One tree's node: its cluster (namespace, bucket), worker and per-round overheads."""

    label: str
    tree: Path
    cluster: Cluster
    worker: WorkerProcess
    folder: Path
    jobs: list[tuple[int, str, float]] = field(default_factory=list)  # (round, id, latency)

    def overheads(self) -> dict[int, list[float]]:
        """Per round, each job's latency minus its own forward, encode and upload (ms)."""
        forwards = read_forwards(self.folder / "forwards.log", 0.0)
        rounds: dict[int, list[float]] = {}
        for index, job_id, latency in self.jobs:
            record = self.cluster.store.get(job_id)
            started, finished = record.started_at or 0.0, record.finished_at or 0.0
            inside = [b - a for a, b, _ in forwards if started <= a and b <= finished]
            own = inside[0] + float(record.metrics["encode_s"]) + float(record.metrics["upload_s"])
            rounds.setdefault(index, []).append((latency - own) * 1e3)
        return rounds


def start_side(
    label: str, tree: Path, endpoint: str, tmp: Path, name: str = "tiny", spec: str = TINY_SPEC
) -> Side:
    """A namespace and bucket, and a `kiln worker` from `tree` serving `name=spec`.

    Returns before the worker is ready.
    """
    namespace = f"kiln-bench-ab-{label}-{secrets.token_hex(4)}"
    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
        aws_secret_access_key="bench",
    ).create_bucket(Bucket=namespace)  # fmt: skip
    folder = tmp / label
    folder.mkdir()
    env = {
        **os.environ,
        "KILN_TEST_REDIS_URL": TEST_REDIS_URL,
        "KILN_REDIS_NAMESPACE": namespace,
        "KILN_STORAGE_URL": f"s3://{namespace}/outputs",
        "KILN_S3_ENDPOINT_URL": endpoint,
        "KILN_S3_REGION": "us-east-1",
        "KILN_S3_ADDRESSING_STYLE": "path",
        "KILN_S3_ACCESS_KEY_ID": "bench",
        "KILN_S3_SECRET_ACCESS_KEY": "bench",
        "KILN_PIPELINES": f'["default", "{name}"]',
        "KILN_TEST_COMPLETIONS": str(folder / "completions.log"),
        "KILN_BENCH_FORWARDS": str(folder / "forwards.log"),
        "KILN_BENCH_TORCH_THREADS": "1",
        "KILN_CPU_THREADS_PER_RANK": "1",
        "KILN_METRICS_PORT": "0",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(tree),  # `kiln` (and the bench pipeline) from that tree
    }
    cluster = Cluster(env=env, tmp=folder)
    node_id = f"node-{label}-{secrets.token_hex(4)}"
    args = [sys.executable, "-m", "kiln.tasks.cli", "worker", "--devices", "cpu:1", "--node-id",
            node_id, "--max-batch", "4", "--loglevel", "WARNING", "--pipeline",
            f"{name}={spec}"]  # fmt: skip
    log_path = folder / "worker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    worker = WorkerProcess(process, node_id, log_path, cluster.store)
    return Side(label, tree, cluster, worker, folder)


@contextlib.contextmanager
def sides(base: Path, tmp: Path) -> Iterator[list[Side]]:
    """moto, then a node from `base` and one from this tree; everything stopped and deleted."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    started: list[Side] = []
    try:
        for label, tree in (("base", base), ("candidate", ROOT)):
            started.append(start_side(label, tree, f"http://{host}:{port}", tmp))
        for side in started:
            side.worker.wait_ready(timeout_s=600)
        yield started
    finally:
        for side in started:
            side.worker.stop()
        moto.stop()
        for side in started:
            with contextlib.suppress(Exception):
                delete_namespace(TEST_REDIS_URL, side.cluster.storage_settings.redis_namespace)


def run_one(side: Side, request: JobRequest) -> tuple[str, float]:
    """Submit one job and wait for its terminal event; (job id, latency in s)."""
    started = time.time()
    record, _ = side.cluster.intake.submit(request)
    state = wait_event(side.cluster.store, record.id)
    if state != "succeeded":
        raise RuntimeError(f"{side.label}: job {record.id} ended {state}")
    return record.id, time.time() - started


def p50_p90(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered):6.2f} / {ordered[int(0.9 * (len(ordered) - 1))]:6.2f}"


def main() -> None:
    """Start both nodes, run the interleaved rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path, help="the base tree (e.g. `git archive HEAD`)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=30, help="jobs per round and side")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kiln-ab-") as folder,
        sides(args.base.resolve(), Path(folder)) as both,
    ):
        requests = tiny_requests(WARMUP_JOBS + args.rounds * args.jobs, "ab")
        for index, request in enumerate(requests):
            for side in both if index % 2 else both[::-1]:
                job_id, latency = run_one(side, request)
                if index >= WARMUP_JOBS:
                    side.jobs.append(((index - WARMUP_JOBS) // args.jobs, job_id, latency))
        results = {side.label: side.overheads() for side in both}
    print(f"overhead p50 / p90 ms (L - forward - encode_s - upload_s), {args.jobs} jobs a round")
    for index in range(args.rounds):
        cells = [f"{label} {p50_p90(rounds[index])}" for label, rounds in results.items()]
        print(f"round {index + 1}: " + "   ".join(cells))
    for label, rounds in results.items():
        print(f"all {label}: {p50_p90([v for values in rounds.values() for v in values])}")


if __name__ == "__main__":
    main()
