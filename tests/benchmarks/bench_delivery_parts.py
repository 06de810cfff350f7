"""The parts of the per-job overhead changed for issue 12, old way and new way side by side.

Run: `.venv/bin/python tests/benchmarks/bench_delivery_parts.py [--rounds 300]`.

Needs Redis (KILN_TEST_REDIS_URL or 127.0.0.1:6379); starts a moto S3 server in this process.
Each round times both ways of each part back to back (alternating which goes first), so a noisy,
shared machine slows both alike; the table prints the p50 of each and their ratio:

1. upload of a 2 KiB PNG-sized object: put + HEAD read-back (`KILN_UPLOAD_VERIFY=head`) vs put
   whose echoed checksum is trusted (`checksum`);
2. the API's key lookup: a Redis read per request (`KILN_API_KEY_CACHE_S=0`) vs the cache;
3. a job's encode + upload (64x64 PNG, trusted checksum) with its `encoding` and `uploading`
   progress written on the task thread, each waited for (`write_now`), vs handed to the progress
   writer's stage thread (`write_soon`), the task thread waiting only before the terminal
   transition (`settle`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import numpy as np
import redis
from moto.server import ThreadedMotoServer
from pydantic import SecretStr

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kiln.storage.apikeys import ApiKeyStore  # noqa: E402
from kiln.storage.job_store import JobStore, NewJob  # noqa: E402
from kiln.storage.objects import new_attempt_name, output_key  # noqa: E402
from kiln.storage.s3_store import S3ObjectStore  # noqa: E402
from kiln.storage.settings import StorageSettings  # noqa: E402
from kiln.tasks.api.auth import Authenticator, hash_api_key, new_api_key  # noqa: E402
from kiln.tasks.contract.events import ProgressData  # noqa: E402
from kiln.tasks.contract.job_spec import JobSpec  # noqa: E402
from kiln.tasks.node.output_uploads import UploadVerify, encode_and_upload, put_verified  # noqa: E402
from kiln.tasks.node.progress_writer import PendingProgress, ProgressWriter  # noqa: E402
from kiln.tasks.webhooks.event_sink import EventSink  # noqa: E402
from tests.conftest import TEST_REDIS_URL  # noqa: E402

Timed = Callable[[int], object]


def timed(run: Timed, index: int) -> float:
    started = time.perf_counter()
    run(index)
    return (time.perf_counter() - started) * 1000


def compare(label: str, old: Timed, new: Timed, rounds: int) -> None:
    """Time `old` and `new` once per round, alternating which goes first; print p50s and ratio."""
    olds, news = [], []
    for index in range(rounds):
        if index % 2:
            news.append(timed(new, index))
            olds.append(timed(old, index))
        else:
            olds.append(timed(old, index))
            news.append(timed(new, index))
    old_p50, new_p50 = statistics.median(olds), statistics.median(news)
    print(
        f"{label:<40} {old_p50:8.2f} ms {new_p50:8.2f} ms   new/old {new_p50 / old_p50:5.2f}",
        flush=True,
    )


@contextlib.contextmanager
def moto_objects() -> Iterator[S3ObjectStore]:
    """An object store on a moto server of this process, bucket created."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = StorageSettings(
        storage_url="s3://kiln-bench/outputs",
        s3_endpoint_url=f"http://{host}:{port}",
        s3_region="us-east-1",
        s3_addressing_style="path",
        s3_access_key_id="bench",
        s3_secret_access_key=SecretStr("bench"),
    )
    store = S3ObjectStore.from_settings(settings)
    boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    ).create_bucket(Bucket="kiln-bench")
    try:
        yield store
    finally:
        server.stop()


def uploads(store: S3ObjectStore, rounds: int) -> None:
    data = secrets.token_bytes(2048)

    def put(verify: UploadVerify) -> Timed:
        def run(index: int) -> None:
            index_in_job = 0 if verify == "head" else 1
            key = output_key(store.prefix, f"job{index}", index_in_job, "png", attempt="1-0123abcd")
            put_verified(store, key, data, "image/png", {}, verify)

        return run

    compare("upload: put + HEAD vs trusted checksum", put("head"), put("checksum"), rounds)


def held_and_started(jobs: JobStore, job_id: str) -> int:
    """Start a queued job as a node does (hold its lease, then start it); its lease token."""
    token, _ = jobs.hold(job_id, "bench", "bench", 0)
    jobs.start(job_id, token, node_id="bench")
    return token


def stage_progress(jobs: JobStore, objects: S3ObjectStore, rounds: int) -> None:
    writer = ProgressWriter(interval_s=60.0)
    sink = EventSink(jobs)
    writer.start()
    frames = np.random.default_rng(0).integers(0, 255, (1, 64, 64, 3), dtype=np.uint8)
    request = JobSpec(prompt="bench", output_format="png", fps=8, seed=0)

    def running_jobs() -> list[tuple[str, int]]:
        news = [NewJob(id=secrets.token_hex(8), request={}) for _ in range(rounds)]
        jobs.create_jobs(news)
        return [(new.id, held_and_started(jobs, new.id)) for new in news]

    started = {False: running_jobs(), True: running_jobs()}

    def encode_upload(handed_over: bool) -> Timed:
        write = writer.write_soon if handed_over else writer.write_now

        def run(index: int) -> None:
            job_id, token = started[handed_over][index]

            def on_stage(stage: str, step: int, total: int) -> None:
                progress = ProgressData(stage=stage, step=step, total=total)
                write(job_id, PendingProgress(sink.job(job_id, token), progress))

            encode_and_upload(
                objects, job_id, request, [frames], attempt=new_attempt_name(token),
                retry_for_s=10.0, on_stage=on_stage, verify="checksum",
            )  # fmt: skip
            writer.settle(job_id)  # what the task thread waits for before `succeed`

        return run

    try:
        compare("encode+upload: stage writes waited/not", encode_upload(False),
                encode_upload(True), rounds)  # fmt: skip
    finally:
        writer.stop()


def key_lookups(store: JobStore, settings: StorageSettings, rounds: int) -> None:
    keys = ApiKeyStore(store.redis, settings)
    secret = new_api_key()
    keys.create(hash_api_key(secret), "bench")
    header = f"Bearer {secret}"
    uncached = Authenticator(keys, enabled=True, cache_s=0.0)
    cached = Authenticator(keys, enabled=True, cache_s=1.0)
    compare(
        "API key lookup: Redis vs cache",
        lambda _: uncached.principal(header),
        lambda _: cached.principal(header),
        rounds,
    )


def main() -> None:
    """Run the three comparisons and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    redis_url = TEST_REDIS_URL
    namespace = f"kiln-bench-{secrets.token_hex(4)}"
    settings = StorageSettings(redis_url=redis_url, redis_namespace=namespace)
    store = JobStore.from_settings(settings)
    print(f"{'p50 per call, ' + str(args.rounds) + ' rounds':<40} {'old':>11} {'new':>11}")
    try:
        with moto_objects() as objects:
            uploads(objects, args.rounds)
            stage_progress(store, objects, args.rounds)
        key_lookups(store, settings, args.rounds)
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            client.delete(key)


if __name__ == "__main__":
    main()
