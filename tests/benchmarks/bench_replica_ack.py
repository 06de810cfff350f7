"""The cost per job of the write-acknowledgement rule (KILN_REDIS_MIN_REPLICAS_ACK), on loopback.

A primary and its replica (Debian's redis-server, or the one on PATH) on free ports; one job's
store calls as a node and the API make them — `create_and_place` (the API's submit), then
`hold`, `start` and `succeed` (a node's delivery, start and end) — run `--jobs` times one after
another, with the rule off (0) and on (1 replica must `WAIT`-acknowledge each). Prints the
median and p99 wall time of those four calls per job, and the difference:

    .venv/bin/python -m tests.benchmarks.bench_replica_ack --jobs 2000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kiln.storage.job_store import JobStore
from kiln.storage.records import NewJob
from kiln.storage.settings import StorageSettings
from tests.e2e.sentinel_rig import RedisNode, redis_binary


def per_job_ms(store: JobStore, jobs: int) -> list[float]:
    """Wall time (ms) of create, hold, start and succeed of each of `jobs` jobs, one by one."""
    times = []
    for _ in range(jobs):
        job_id = uuid.uuid4().hex
        started = time.perf_counter()
        store.create_and_place(NewJob(id=job_id, request={"prompt": "x"}))
        token, _record = store.hold(job_id, "bench-node/1", "bench-node", 0)
        store.start(job_id, token, node_id="bench-node")
        store.succeed(job_id, token, [], {})
        times.append((time.perf_counter() - started) * 1000)
    return times


def main() -> None:
    """Measure with the rule off and on; print per-job figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    options = parser.parse_args()
    binary = redis_binary()
    if binary is None:
        raise SystemExit("no redis-server installed")
    with tempfile.TemporaryDirectory() as folder:
        primary = RedisNode(binary, Path(folder) / "primary")
        replica = RedisNode(binary, Path(folder) / "replica", replica_of=primary.port)
        try:
            replica.wait_in_sync()
            url = f"redis://127.0.0.1:{primary.port}/0"
            for acks in (0, 1, 0, 1):  # twice each, interleaved: a busy machine drifts
                settings = StorageSettings(redis_url=url, redis_min_replicas_ack=acks)
                times = per_job_ms(JobStore.from_settings(settings), options.jobs)
                median, p99 = statistics.median(times), statistics.quantiles(times, n=100)[98]
                print(
                    f"min_replicas_ack={acks}: {options.jobs} jobs, per job (create + hold + start "
                    f"+ succeed) median {median:.3f} ms, p99 {p99:.3f} ms"
                )
        finally:
            replica.stop()
            primary.stop()


if __name__ == "__main__":
    main()
