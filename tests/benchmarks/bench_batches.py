"""Overnight batches: acceptance rate and API memory, Redis memory while feeding, group busy ratio.

Run: `.venv/bin/python tests/benchmarks/bench_batches.py [--only accept,redis,busy]
[--accept 10000,100000] [--redis 10000,100000] [--million] [--redis-finish 20000]
[--busy-jobs 160] [--baseline DIR] [--s3]`. `--million` adds a 1,000,000-line file to accept and
redis (about 110 MB; each takes a minute or two to accept on 2 shared cores).

1. accept: a JSONL file POSTed to /v1/batches through `KilnClient.submit_batch` (streamed), the
   API in its own uvicorn process; lines/s, the API's CPU per line (user + system, from /proc:
   barely moved by what else the machine runs, so `lines/s per core` = 1 / that is what the API
   reaches on a core of its own) and the API's peak RSS (VmHWM) after each size, all sizes sent
   to one API in turn. Flat memory means the peak after the big file is no higher than after the
   small one. `--baseline DIR` runs a second API from another tree of the code (e.g. the commit
   before: `git archive HEAD | tar -x -C DIR`) side by side: each file goes to both, in
   alternating order, and each line prints both and their ratio. `--s3` stores the batches in
   a moto S3 server (in this process) instead of a local folder.
2. redis: a batch accepted the same way (HTTP, an API process of its own) and fed by a real
   `BatchFeeder`, its jobs run to success by hand as fast as the store allows (no node); Redis
   `used_memory` above the empty baseline right after acceptance and at its peak while feeding,
   per line of the batch. A batch runs until `--redis-finish` lines are done (a full 1M would
   take too long by hand).
   Finished job records are kept for `KILN_BATCH_ITEM_RETENTION_S`; it is set to 0 here, so the
   figure is what feeding itself holds (with retention on, finished records add up until expiry).
3. busy: two `kiln worker` nodes serving the `busy` fixture pipeline (sleeps per request); the
   same jobs fed as one batch, then submitted one by one up front (the baseline). Busy ratio =
   forward time summed over both nodes / (2 × wall time from first forward start to last end).

Needs `redis-server` on PATH (each part starts a private one, no persistence, so its memory is
the batch's alone). Everything runs in a temporary folder that is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kiln.common.states import JobState  # noqa: E402
from kiln.storage.apikeys import ApiKeyStore  # noqa: E402
from kiln.storage.batch_store import BatchFeeding, BatchStore  # noqa: E402
from kiln.storage.job_store import JobStore  # noqa: E402
from kiln.storage.settings import StorageSettings  # noqa: E402
from kiln.tasks.api.auth import hash_api_key, new_api_key  # noqa: E402
from kiln.tasks.cli.embedded import free_port, wait_for_port  # noqa: E402
from kiln.tasks.client.client import KilnClient  # noqa: E402
from tests.e2e.cluster import Cluster, process_cpu_s  # noqa: E402

LINE = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 2}
BUSY_SPEC = "python:tests.benchmarks.bench_pipelines:busy"


def write_batch(path: Path, lines: int) -> Path:
    with path.open("w") as handle:
        for n in range(lines):
            handle.write(json.dumps({**LINE, "seed": n, "custom_id": f"l{n:07d}"}) + "\n")
    return path


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_for_port(port, 10)
    return server, f"redis://127.0.0.1:{port}/0"


def base_env(redis_url: str, folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "KILN_REDIS_URL": redis_url,
        "KILN_REDIS_NAMESPACE": f"kiln-bench-{secrets.token_hex(4)}",
        "KILN_STORAGE_URL": f"file://{folder / 'outputs'}",
        "KILN_PIPELINES": '["tiny", "busy"]',
        "KILN_METRICS_PORT": "0",
    }


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


# --- 1. accepting a file through the API ----------------------------------------------------
@contextmanager
def api_process(
    env: dict[str, str], root: Path = ROOT
) -> Iterator[tuple[KilnClient, subprocess.Popen[bytes]]]:
    """The API (of the code tree `root`) in a uvicorn process of its own, a client with a key."""
    key = new_api_key()
    with patch.dict(os.environ, clear=True, values=env):
        storage = StorageSettings()
    keys = ApiKeyStore(JobStore.from_settings(storage).redis, storage)
    keys.create(hash_api_key(key), "b", False)
    port = free_port()
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); "
        "from kiln.storage.settings import StorageSettings; "
        "from kiln.tasks.contract.settings import KilnSettings; "
        "from kiln.tasks.api.app import serve_api; "
        f"serve_api(KilnSettings(), StorageSettings(), '127.0.0.1', {port}, "
        "log_level='warning', access_log=False)"
    )
    api = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env)
    try:
        wait_for_port(port, timeout_s=60)
        with KilnClient(f"http://127.0.0.1:{port}", key, timeout=3600) as client:
            client.submit_batch(iter([{**LINE, "custom_id": "warm"}]), pipeline="tiny")
            yield client, api
    finally:
        api.terminate()
        api.wait(30)


def accept_file(client: KilnClient, path: Path, lines: int) -> tuple[str, float]:
    """POST the file (streamed); the batch id and the seconds it took."""
    started = time.perf_counter()
    view = client.submit_batch(path, pipeline="tiny")
    elapsed = time.perf_counter() - started
    assert view.counts.total == lines
    return view.id, elapsed


@dataclass
class Accepted:
    """One file accepted by one API."""

    seconds: float
    cpu_s: float
    peak_mb: float


def accept_measured(client: KilnClient, api: subprocess.Popen[bytes], path: Path) -> Accepted:
    """Accept the file; its wall time, the API's CPU for it and the API's peak RSS after it."""
    lines = sum(1 for _ in path.open("rb"))
    before = process_cpu_s(api.pid)
    _, elapsed = accept_file(client, path, lines)
    return Accepted(elapsed, process_cpu_s(api.pid) - before, peak_rss_mb(api.pid))


def accept_line(label: str, lines: int, got: Accepted) -> str:
    """One API's figures for one file."""
    return (
        f"{label:<9} {lines / got.seconds:8.0f} lines/s ({got.seconds:7.2f} s), "
        f"API CPU {got.cpu_s / lines * 1e6:6.1f} us/line = {lines / got.cpu_s:7.0f} lines/s "
        f"per core, API peak RSS {got.peak_mb:7.1f} MB"
    )


def bench_accept(sizes: list[int], folder: Path, baseline: Path | None, s3: bool) -> None:
    server, redis_url = start_redis(folder)
    trees = {"this": ROOT} if baseline is None else {"this": ROOT, "baseline": baseline}
    try:
        with ExitStack() as stack:
            apis = {}
            for label, root in trees.items():
                env = {**base_env(redis_url, folder), "KILN_AUTH_ENABLED": "true"}
                if s3:
                    env.update(stack.enter_context(s3_storage()))
                apis[label] = stack.enter_context(api_process(env, root))
                print(
                    f"accept: {label} API peak RSS before any file "
                    f"{peak_rss_mb(apis[label][1].pid):7.1f} MB",
                    flush=True,
                )
            for turn, lines in enumerate(sizes):
                path = write_batch(folder / f"accept-{lines}.jsonl", lines)
                print(f"accept: {lines:>9} lines ({path.stat().st_size / 1e6:6.1f} MB)", flush=True)
                order = list(apis) if turn % 2 == 0 else list(apis)[::-1]
                got = {label: accept_measured(*apis[label], path) for label in order}
                for label in apis:
                    print(f"  {accept_line(label, lines, got[label])}", flush=True)
                if baseline is not None:
                    this, base = got["this"], got["baseline"]
                    print(
                        f"  ratio     {base.seconds / this.seconds:8.2f}x lines/s, "
                        f"{this.cpu_s / base.cpu_s:5.2f}x API CPU per line, "
                        f"peak RSS {this.peak_mb - base.peak_mb:+6.1f} MB",
                        flush=True,
                    )
                path.unlink()
    finally:
        server.terminate()
        server.wait(10)


@contextmanager
def s3_storage() -> Iterator[dict[str, str]]:
    """A moto S3 server in this process with a fresh bucket: the settings naming it."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        bucket = f"kiln-bench-{secrets.token_hex(4)}"
        s3 = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
        )
        s3.create_bucket(Bucket=bucket)
        yield {
            "KILN_STORAGE_URL": f"s3://{bucket}/outputs",
            "KILN_S3_ENDPOINT_URL": endpoint,
            "KILN_S3_REGION": "us-east-1",
            "KILN_S3_ADDRESSING_STYLE": "path",
            "KILN_S3_ACCESS_KEY_ID": "bench",
            "KILN_S3_SECRET_ACCESS_KEY": "bench",
        }
    finally:
        server.stop()


# --- 2. Redis memory while a batch is fed ----------------------------------------------------
def bench_redis(sizes: list[int], finish_at_most: int, folder: Path) -> None:
    for lines in sizes:
        server, redis_url = start_redis(folder)
        env = {**base_env(redis_url, folder), "KILN_AUTH_ENABLED": "true"}
        client = redis.Redis.from_url(redis_url)
        try:
            with api_process(env) as (api_client, _api):
                empty = int(client.info("memory")["used_memory"])
                path = write_batch(folder / f"redis-{lines}.jsonl", lines)
                batch_id, accept_s = accept_file(api_client, path, lines)
                path.unlink()
                accepted = int(client.info("memory")["used_memory"]) - empty
                started = time.perf_counter()
                peak, done = feed_and_measure(batch_id, finish_at_most, env, client, empty)
                feed_s = time.perf_counter() - started
        finally:
            server.terminate()
            server.wait(10)
        print(
            f"redis: {lines:>9} lines accepted via HTTP in {accept_s:6.1f} s "
            f"({lines / accept_s:6.0f} lines/s), Redis +{accepted / 1e6:5.2f} MB; "
            f"{done:>6} fed and run in {feed_s:6.1f} s: Redis peak {peak / 1e6:6.2f} MB "
            f"above empty = {peak / lines:7.1f} bytes/line of the batch",
            flush=True,
        )


def feed_and_measure(
    batch_id: str, finish: int, env: dict[str, str], client: redis.Redis[bytes], empty: int
) -> tuple[int, int]:
    """Feed the batch with a real feeder, running its queued jobs to success by hand."""
    from kiln.storage.objects import open_object_store
    from kiln.tasks.batches.feeder import BatchFeeder
    from kiln.tasks.contract.settings import KilnSettings
    from kiln.tasks.queue.submit import Submitter
    from tests.tasks.helpers import drive_to_success

    with patch.dict(os.environ, clear=True, values=env):
        storage, settings = StorageSettings(), KilnSettings()
    settings = settings.model_copy(
        update={"batch_item_retention_s": 0, "batch_results_flush_s": 0.5}
    )
    store, objects = JobStore.from_settings(storage), open_object_store(storage)
    submitter = Submitter(store, settings, publish=lambda *_a, **_k: None)
    feeder = BatchFeeder(store, objects, submitter, settings, "bench")
    feeding = BatchFeeding(store.redis, store.settings)
    total = BatchStore(store.redis, store.settings).get_fed(batch_id).items
    peak, done = 0, 0
    while done < min(total, finish):
        feeder.tick()
        for job_id, _line in feeding.open_items(batch_id):
            if store.get(job_id).state == JobState.QUEUED:
                drive_to_success(store, job_id, steps=1)
                done += 1
        peak = max(peak, int(client.info("memory")["used_memory"]) - empty)
    return peak, done


# --- 3. busy ratio of two nodes fed by a batch -----------------------------------------------
def bench_busy(jobs: int, sleep_s: float, folder: Path) -> None:
    for mode in ("batch", "one by one"):
        server, redis_url = start_redis(folder)
        run = folder / f"busy-{mode.replace(' ', '-')}"
        run.mkdir()
        forwards = run / "forwards.txt"
        env = {
            **base_env(redis_url, run),
            "KILN_TEST_COMPLETIONS": str(run / "completions.log"),
            "KILN_BENCH_FORWARDS": str(forwards),
            "KILN_BENCH_SLEEP_S": str(sleep_s),
            "KILN_BATCH_FEED_INTERVAL_S": "0.1",
        }
        cluster = Cluster(env=env, tmp=run)
        try:
            for _ in range(2):
                cluster.start_worker(f"busy={BUSY_SPEC}", wait=False)
            for worker in cluster.workers:
                worker.wait_ready()
            ratio = busy_run(cluster, mode, jobs, run)
        finally:
            cluster.stop_all()
            server.terminate()
            server.wait(10)
        print(f"busy: {jobs} jobs, {sleep_s} s each, 2 nodes, {mode:<10}: busy ratio {ratio:6.1%}")


def busy_run(cluster: Cluster, mode: str, jobs: int, run: Path) -> float:
    lines = [{**LINE, "seed": n, "custom_id": f"b{n:05d}"} for n in range(jobs)]
    # each node's warm-up forward at start-up is no job's: counting it put the nodes' start-up
    # skew and the time until the first job exists into the wall (bench_batch_busy.py `raw`)
    submitted_at = time.time()
    if mode == "batch":
        path = run / "batch.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        answer = cluster.run_cli(
            "batch", "submit", str(path), "--pipeline", "busy", "--wait", "--json", timeout_s=3600
        )
        assert answer.returncode == 0, answer.stderr
    else:
        ids = [
            cluster.submit(pipeline="busy", **{k: v for k, v in line.items() if k != "custom_id"})
            for line in lines
        ]
        for job_id in ids:
            cluster.wait_for(job_id, timeout_s=3600)
    spans = [
        span
        for row in (run / "forwards.txt").read_text().splitlines()
        if (span := tuple(map(float, row.split()[:2])))[0] >= submitted_at
    ]
    busy = sum(end - start for start, end in spans)
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return busy / (2 * wall)


def main() -> None:
    """Run the chosen measurements; print one line each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default="accept,redis,busy")
    parser.add_argument("--accept", default="10000,100000")
    parser.add_argument("--redis", default="10000,100000")
    parser.add_argument(
        "--million", action="store_true", help="add a 1,000,000-line file to accept and redis"
    )
    parser.add_argument("--redis-finish", type=int, default=20_000)
    parser.add_argument("--busy-jobs", type=int, default=160)
    parser.add_argument("--busy-sleep", type=float, default=0.2)
    parser.add_argument("--baseline", type=Path, help="accept: another tree, run alongside")
    parser.add_argument("--s3", action="store_true", help="accept: store in a moto S3 server")
    args = parser.parse_args()
    only = set(args.only.split(","))
    million = [1_000_000] if args.million else []
    print(f"{os.cpu_count()} CPUs (shared); private redis-server per part", flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-batches-") as tmp:
        folder = Path(tmp)
        if "accept" in only:
            sizes = [int(n) for n in args.accept.split(",")] + million
            baseline = args.baseline.resolve() if args.baseline else None
            bench_accept(sizes, folder, baseline, args.s3)
        if "redis" in only:
            sizes = [int(n) for n in args.redis.split(",")] + million
            bench_redis(sizes, args.redis_finish, folder)
        if "busy" in only:
            bench_busy(args.busy_jobs, args.busy_sleep, folder)


if __name__ == "__main__":
    main()
