"""Benchmark: creating job records through the bulk path vs one round trip per job.

Run: .venv/bin/python tests/benchmarks/bench_storage.py [--jobs 100000] [--chunk 1000]
Needs a Redis (KILN_TEST_REDIS_URL or redis://127.0.0.1:6379/0); writes under a random
namespace and deletes it afterwards. Not collected by pytest. Prints the load average too:
on a shared machine the numbers move with it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the repo

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.settings import StorageSettings
from tests.conftest import TEST_REDIS_URL
from tests.storage.fed_batches import record_fed_batch


def make_jobs(count: int, batch_id: str) -> list[NewJob]:
    """Jobs shaped like a bulk file's lines: a realistic request, a batch, the bulk lane."""
    return [
        NewJob(
            id=f"{batch_id}-{i:07d}",
            request={
                "pipeline": "tiny",
                "prompt": f"a watercolor painting of lighthouse number {i}",
                "width": 512,
                "height": 512,
                "num_frames": 1,
                "steps": 30,
                "guidance_scale": 7.5,
                "seed": i,
                "num_outputs": 1,
                "output_format": "png",
            },
            batch_id=batch_id,
            metadata={"line": str(i)},
            owner="bench",
            lane="bulk",
        )
        for i in range(count)
    ]


def delete_namespace(store: JobStore) -> None:
    """Delete every key of the store's namespace."""
    pattern = f"{store.settings.redis_namespace}:*"
    keys: list[str] = []
    for key in store.redis.scan_iter(match=pattern, count=10_000):
        keys.append(key)
        if len(keys) >= 1000:
            store.redis.unlink(*keys)
            keys = []
    if keys:
        store.redis.unlink(*keys)


def timed_run(
    redis_url: str, count: int, create: Callable[[JobStore, list[NewJob]], None]
) -> tuple[float, float]:
    """Create `count` jobs with `create` in a fresh namespace; returns (records/s, bytes each)."""
    namespace = f"kiln-bench-{secrets.token_hex(6)}"
    store = JobStore.from_settings(StorageSettings(redis_url=redis_url, redis_namespace=namespace))
    try:
        batches = record_fed_batch(store, "bench", count)
        jobs = make_jobs(count, "bench")
        memory_before = store.redis.info("memory")["used_memory"]
        started = time.perf_counter()
        create(store, jobs)
        elapsed = time.perf_counter() - started
        memory_after = store.redis.info("memory")["used_memory"]
        batch = batches.get_fed("bench")
        assert batch.counts[JobState.QUEUED] == count == store.queue_depth()
        return count / elapsed, (memory_after - memory_before) / count
    finally:
        delete_namespace(store)
        store.redis.close()


def main() -> None:
    """Parse arguments, run both paths, print records/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--chunk", type=int, default=1000, help="jobs per pipelined round trip")
    parser.add_argument(
        "--redis-url",
        default=TEST_REDIS_URL,
    )
    args = parser.parse_args()

    def bulk(store: JobStore, jobs: list[NewJob]) -> None:
        store.create_jobs(jobs, chunk_size=args.chunk)

    def one_by_one(store: JobStore, jobs: list[NewJob]) -> None:
        for job in jobs:
            store.create_job(job)

    load_before = os.getloadavg()[0]
    bulk_rate, bytes_each = timed_run(args.redis_url, args.jobs, bulk)
    single_rate, _ = timed_run(args.redis_url, args.jobs, one_by_one)
    print(f"jobs: {args.jobs}, chunk: {args.chunk}, redis: {args.redis_url}")
    print(f"load average (1 min): {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"bulk (create_jobs, pipelined):      {bulk_rate:10,.0f} records/s")
    print(f"one round trip each (create_job):   {single_rate:10,.0f} records/s")
    print(f"ratio bulk / one-by-one:            {bulk_rate / single_rate:10.1f}x")
    print(f"Redis memory per queued record:     {bytes_each:10,.0f} bytes (approximate)")


if __name__ == "__main__":
    main()
