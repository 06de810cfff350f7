"""Job submissions per second: through the HTTP API, through KilnClient, and the storage ceiling.

Run: `.venv/bin/python tests/benchmarks/bench_api.py [--jobs 2000] [--concurrency 8]
[--baseline DIR] [--rounds 3]`. Needs Redis (KILN_TEST_REDIS_URL or 127.0.0.1:6379). The API
runs in its own process (uvicorn, auth on, one key) so the load generator does not share its
interpreter; everything writes to random namespaces that are deleted at the end.

Two load generators: httpx (`concurrency` threads in this process, one keep-alive client each:
what a Python caller does, and itself about as costly per request as the API) and a light one
(tests/benchmarks/http_load.py: `concurrency` keep-alive connections in one asyncio loop, as
`wrk` would). `--baseline DIR` runs a second API from another tree of the code (e.g. the commit
before: `git archive HEAD | tar -x -C DIR`) side by side, the two measured in turn each round,
and prints both with their ratio; on a shared machine only such interleaved ratios mean much.

`--workers N` runs this tree's API as `kiln api --workers N` (N processes on one port under the
supervisor; the baseline keeps 1 process unless `--baseline-workers` says otherwise). Both APIs
then start through the `kiln api` command line, with its default logging, so that they compare
alike; server CPU is then the supervisor's and its children's together. E.g. 1 against 2
processes of this tree: `--workers 2 --baseline .`.

Each line also prints the generator's own CPU per job (this process's): on a machine where the
generator shares the cores with the API, a generator that costs about as much as the API caps
the rate whatever the API does.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kiln.storage.apikeys import ApiKeyStore  # noqa: E402
from kiln.storage.job_store import JobStore, NewJob  # noqa: E402
from kiln.storage.settings import StorageSettings  # noqa: E402
from kiln.tasks.api.auth import hash_api_key, new_api_key  # noqa: E402
from kiln.tasks.cli.embedded import free_port, wait_for_port  # noqa: E402
from kiln.tasks.client.client import KilnClient  # noqa: E402
from kiln.tasks.contract.schemas import JobRequest  # noqa: E402
from tests.benchmarks.http_load import post_many  # noqa: E402
from tests.conftest import TEST_REDIS_URL  # noqa: E402
from tests.e2e.cluster import process_cpu_s  # noqa: E402

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


@dataclass
class Api:
    """One API process under test: the tree it runs, its port, its key and namespace."""

    label: str
    root: Path
    namespace: str
    workers: int | None = None  # None: serve_api in-process, quiet; N: `kiln api`, N processes
    key: str = ""
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    rates: dict[str, list[float]] = field(default_factory=dict)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)  # server CPU per job
    load_cpu_ms: dict[str, list[float]] = field(default_factory=dict)  # the generator's, per job

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, redis_url: str) -> None:
        storage = StorageSettings(redis_url=redis_url, redis_namespace=self.namespace)
        store = JobStore.from_settings(storage)
        self.key = new_api_key()
        ApiKeyStore(store.redis, storage).create(hash_api_key(self.key), "bench", admin=False)
        self.port = free_port()
        env = {
            **os.environ,
            "KILN_REDIS_URL": redis_url,
            "KILN_REDIS_NAMESPACE": self.namespace,
            "KILN_MAX_QUEUE_DEPTH": str(10**9),
            "KILN_AUTH_ENABLED": "true",
        }
        # output dropped: the API logs a line per accepted job (and uvicorn one per request)
        self.process = subprocess.Popen(
            self.command(),
            cwd=self.root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, timeout_s=60)
        spread(20 * (self.workers or 1), 4, http_submitter(self.url, self.key))  # warm up

    def command(self) -> list[str]:
        """The API of `root`: quiet in-process serve_api, or the `kiln api` command line."""
        if self.workers is not None:  # `python -m` imports `kiln` from cwd, i.e. `root`
            command = [sys.executable, "-m", "kiln.tasks.cli", "api", "--port", str(self.port)]
            return command + (["--workers", str(self.workers)] if self.workers > 1 else [])
        code = (
            f"import sys; sys.path.insert(0, {str(self.root)!r}); "
            "from kiln.storage.settings import StorageSettings; "
            "from kiln.tasks.contract.settings import KilnSettings; "
            "from kiln.tasks.api.app import serve_api; "
            f"serve_api(KilnSettings(), StorageSettings(), '127.0.0.1', {self.port}, "
            "log_level='warning', access_log=False)"
        )
        return [sys.executable, "-c", code]

    def measure(self, label: str, jobs: int, run: Callable[[], None]) -> None:
        cpu_before, load_before = self.cpu_s(), time.process_time()
        self.rates.setdefault(label, []).append(rate(f"{self.label}: {label}", jobs, run))
        per_job = (self.cpu_s() - cpu_before) / jobs * 1000
        # the generator shares the cores: where it costs as much as the API, it caps the rate
        load_per_job = (time.process_time() - load_before) / jobs * 1000
        self.cpu_ms.setdefault(label, []).append(per_job)
        self.load_cpu_ms.setdefault(label, []).append(load_per_job)
        print(
            f"{'':<48} server CPU {per_job:.2f} ms/job, generator CPU {load_per_job:.2f} ms/job",
            flush=True,
        )

    def cpu_s(self) -> float:
        """CPU seconds the API's processes used so far (user + system, from /proc).

        Unlike jobs/s, barely moved by what else the machine runs: 1 / (CPU per job) is what
        the API would reach on a core of its own.
        """
        assert self.process is not None
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return sum(process_cpu_s(int(p)) for p in [str(pid), *children])

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=30)


def light_load(api: Api, jobs: int, concurrency: int) -> None:
    """`jobs` submissions from the light generator (tests/benchmarks/http_load.py)."""
    post_many(api.port, api.key, jobs, concurrency)


def measure_round(api: Api, jobs: int, concurrency: int) -> None:
    """One round on one API: both generators, `concurrency` clients."""
    api.measure(
        f"httpx, {concurrency} threads",
        jobs,
        lambda: spread(jobs, concurrency, http_submitter(api.url, api.key)),
    )
    api.measure(
        f"light, {concurrency} connections",
        jobs,
        lambda: light_load(api, jobs, concurrency),
    )


def _spread_of(values: list[float], fmt: str) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def summary(apis: list[Api]) -> None:
    """Medians per API and generator, and the candidate's ratio to the baseline."""

    def rates(api: Api) -> dict[str, list[float]]:
        return api.rates

    def cpu(api: Api) -> dict[str, list[float]]:
        return api.cpu_ms

    def load_cpu(api: Api) -> dict[str, list[float]]:
        return api.load_cpu_ms

    for title, of, fmt in (
        ("jobs/s", rates, ".0f"),
        ("server CPU ms/job", cpu, ".2f"),
        ("generator CPU ms/job", load_cpu, ".2f"),
    ):
        print(f"\nmedian (min-max) {title} over the rounds:", flush=True)
        for label, first in of(apis[0]).items():
            cells = [f"{api.label} {_spread_of(of(api)[label], fmt)}" for api in apis]
            line = f"  {label:<26} " + "   ".join(cells)
            if len(apis) == 2:
                ratios = [c / b for c, b in zip(first, of(apis[1])[label], strict=True)]
                line += f"   ratio {_spread_of(ratios, '.2f')}"
            print(line, flush=True)


def submitter_rate(store: JobStore, jobs: int) -> None:
    """In-process Intake.submit: checks + record + Celery publish + mark_published, no HTTP."""
    from kiln.tasks.contract.settings import KilnSettings
    from kiln.tasks.intake.intake import Intake
    from kiln.tasks.queue.submit import Submitter

    intake = Intake(Submitter(store, KilnSettings()), None)
    request = JobRequest.model_validate(BODY)

    def loop() -> None:
        for _ in range(jobs):
            intake.submit(request)

    rate("in-process: Intake.submit loop (no HTTP)", jobs, loop)


def storage_ceiling(store: JobStore, jobs: int) -> None:
    def one_by_one() -> None:
        for _ in range(jobs):
            store.create_job(NewJob(id=uuid.uuid4().hex, request=BODY))

    rate("storage: JobStore.create_job loop", jobs, one_by_one)
    news = [NewJob(id=uuid.uuid4().hex, request=BODY) for _ in range(jobs)]
    rate("storage: JobStore.create_jobs bulk", jobs, lambda: store.create_jobs(news))


def label(tree: str, workers: int | None) -> str:
    """The API's name in the table, with its process count when started through `kiln api`."""
    return tree if workers is None else f"{tree} ({workers}p)"


def main() -> None:
    """Run every measurement and print one line each, then the medians."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another tree of the code, run alongside")
    parser.add_argument("--workers", type=int, help="this tree: `kiln api --workers N`")
    parser.add_argument("--baseline-workers", type=int, default=1, help="with --workers")
    args = parser.parse_args()
    redis_url = TEST_REDIS_URL
    cli = args.workers is not None
    namespace = f"kiln-bench-{secrets.token_hex(4)}"
    apis = [Api(label("this tree", args.workers), ROOT, namespace, args.workers)]
    if args.baseline:
        workers = args.baseline_workers if cli else None
        namespace = f"kiln-bench-{secrets.token_hex(4)}"
        apis.append(Api(label("baseline", workers), args.baseline.resolve(), namespace, workers))
    try:
        for api in apis:
            api.start(redis_url)
        print(
            f"{args.jobs} jobs per line; auth on; "
            + ("`kiln api` command line; " if cli else "each API: 1 uvicorn process; ")
            + f"{os.cpu_count()} CPUs shared by server and load",
            flush=True,
        )
        for round_index in range(args.rounds):
            # alternate which API goes first: neither always meets the same machine state
            ordered = apis if round_index % 2 == 0 else apis[::-1]
            for api in ordered:
                measure_round(api, args.jobs, args.concurrency)
        summary(apis)
        candidate = apis[0]
        rate(
            "KilnClient.submit, 1 client",
            args.jobs,
            lambda: client_submitter(candidate.url, candidate.key)(args.jobs),
        )
        store = JobStore.from_settings(
            StorageSettings(redis_url=redis_url, redis_namespace=candidate.namespace)
        )
        submitter_rate(store, args.jobs)
        storage_ceiling(store, args.jobs)
    finally:
        for api in apis:
            api.stop()
        client = redis.Redis.from_url(redis_url)
        for api in apis:
            for key in client.scan_iter(match=f"{api.namespace}:*", count=1000):
                client.delete(key)


if __name__ == "__main__":
    main()
