"""Job submissions per second: through the HTTP API, through KilnClient, and the storage ceiling.

Run: `.venv/bin/python tests/benchmarks/bench_api.py [--jobs 2000] [--concurrency 8]`.
Needs Redis (KILN_TEST_REDIS_URL or 127.0.0.1:6379). The API runs in its own process (uvicorn,
auth on, one key) so the load generator does not share its interpreter; everything writes to a
random namespace that is deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kiln.storage.apikeys import ApiKeyStore  # noqa: E402
from kiln.storage.settings import StorageSettings  # noqa: E402
from kiln.storage.status import JobStore, NewJob  # noqa: E402
from kiln.tasks.api.auth import hash_api_key, new_api_key  # noqa: E402
from kiln.tasks.cli.embedded import free_port, wait_for_port  # noqa: E402
from kiln.tasks.client.client import KilnClient  # noqa: E402
from kiln.tasks.contract.schemas import JobRequest  # noqa: E402

BODY = JobRequest(prompt="a kiln at dusk", width=64, height=64, steps=4, seed=1).to_record()


def rate(label: str, jobs: int, run: Callable[[], None]) -> float:
    """Time `run` (which submits `jobs` jobs) and print jobs/s."""
    started = time.perf_counter()
    run()
    elapsed = time.perf_counter() - started
    per_s = jobs / elapsed
    print(f"{label:<48} {jobs:>6} jobs  {elapsed:7.2f} s  {per_s:9.0f} jobs/s", flush=True)
    return per_s


def spread(jobs: int, concurrency: int, submit_some: Callable[[int], None]) -> None:
    """Split `jobs` over `concurrency` threads, each running `submit_some(count)`."""
    base, extra = divmod(jobs, concurrency)
    shares = [base + (1 if i < extra else 0) for i in range(concurrency)]
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(submit_some, n) for n in shares]:
            future.result()


def http_submitter(url: str, key: str) -> Callable[[int], None]:
    def submit_some(count: int) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            for _ in range(count):
                http.post("/v1/jobs", json=BODY).raise_for_status()

    return submit_some


def client_submitter(url: str, key: str) -> Callable[[int], None]:
    request = JobRequest.model_validate(BODY)

    def submit_some(count: int) -> None:
        with KilnClient(url, key) as client:
            for _ in range(count):
                client.submit(request)

    return submit_some


def start_api(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    code = (
        "from kiln.storage.settings import StorageSettings; "
        "from kiln.tasks.contract.settings import KilnSettings; "
        "from kiln.tasks.api.app import serve_api; "
        f"serve_api(KilnSettings(), StorageSettings(), '127.0.0.1', {port}, "
        "log_level='warning', access_log=False)"
    )
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    wait_for_port(port, timeout_s=60)
    return process


def submitter_rate(store: JobStore, jobs: int) -> None:
    """In-process Submitter.submit: record + Celery publish + mark_published, no HTTP."""
    from kiln.tasks.contract.settings import KilnSettings
    from kiln.tasks.queue.submit import Submitter

    submitter = Submitter(store, KilnSettings())
    request = JobRequest.model_validate(BODY)

    def loop() -> None:
        for _ in range(jobs):
            submitter.submit(request)

    rate("in-process: Submitter.submit loop (no HTTP)", jobs, loop)


def storage_ceiling(store: JobStore, jobs: int) -> None:
    def one_by_one() -> None:
        for _ in range(jobs):
            store.create_job(NewJob(id=uuid.uuid4().hex, request=BODY))

    rate("storage: JobStore.create_job loop", jobs, one_by_one)
    news = [NewJob(id=uuid.uuid4().hex, request=BODY) for _ in range(jobs)]
    rate("storage: JobStore.create_jobs bulk", jobs, lambda: store.create_jobs(news))


def main() -> None:
    """Run every measurement and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    redis_url = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    namespace = f"kiln-bench-{secrets.token_hex(4)}"
    storage = StorageSettings(redis_url=redis_url, redis_namespace=namespace)
    store = JobStore.from_settings(storage)
    key = new_api_key()
    ApiKeyStore(store.redis, storage).create(hash_api_key(key), "bench", admin=False)
    port = free_port()
    env = {
        **os.environ,
        "KILN_REDIS_URL": redis_url,
        "KILN_REDIS_NAMESPACE": namespace,
        "KILN_MAX_QUEUE_DEPTH": str(10**9),
        "KILN_AUTH_ENABLED": "true",
    }
    api = start_api(env, port)
    url = f"http://127.0.0.1:{port}"
    try:
        print(
            f"{args.jobs} jobs per line; API: 1 uvicorn process, auth on; "
            f"{os.cpu_count()} CPUs shared by server and load",
            flush=True,
        )
        http_submitter(url, key)(20)  # warm up
        rate(
            "API: httpx keep-alive, 1 connection",
            args.jobs,
            lambda: http_submitter(url, key)(args.jobs),
        )
        rate(
            f"API: httpx keep-alive, {args.concurrency} concurrent",
            args.jobs,
            lambda: spread(args.jobs, args.concurrency, http_submitter(url, key)),
        )
        rate(
            "KilnClient.submit, 1 client", args.jobs, lambda: client_submitter(url, key)(args.jobs)
        )
        rate(
            f"KilnClient.submit, {args.concurrency} concurrent",
            args.jobs,
            lambda: spread(args.jobs, args.concurrency, client_submitter(url, key)),
        )
        submitter_rate(store, args.jobs)
        storage_ceiling(store, args.jobs)
    finally:
        api.terminate()
        api.wait(timeout=30)
        client = redis.Redis.from_url(redis_url)
        for batch_key in client.scan_iter(match=f"{namespace}:*", count=1000):
            client.delete(batch_key)


if __name__ == "__main__":
    main()
