"""A direct submit (`kiln submit` on Redis, a Python caller of the intake) two ways, side by side.

    .venv/bin/python tests/benchmarks/bench_direct_submit.py [--jobs 300]

Starts a private redis-server (no persistence, its own port) and submits tiny jobs through the
intake, alternating two submitters on one store:
- `published after`: the job's message published by Celery once its record is written, then
  the record marked published (how `kiln submit` and the control loops submitted before every
  way in took the process's submitter);
- `in the creation`: `ProcessParts.submitter`, the message pushed by the creation script.
Prints, for each, the p50/p90 wall time of a submit and the Redis commands it made (INFO
commandstats, counted around each submit; the calls a script makes count as commands).
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from kiln.storage.settings import StorageSettings  # noqa: E402
from kiln.tasks.contract.schemas import JobRequest  # noqa: E402
from kiln.tasks.contract.settings import KilnSettings  # noqa: E402
from kiln.tasks.intake.intake import Intake  # noqa: E402
from kiln.tasks.queue.process import ProcessParts  # noqa: E402
from kiln.tasks.queue.submit import Submitter, celery_publisher  # noqa: E402
from tests.e2e.services import PrivateRedis  # noqa: E402


def commands(client: redis.Redis[bytes]) -> int:
    """Every command the server has run so far (INFO's own included)."""
    stats = client.info("commandstats")
    return sum(int(entry["calls"]) for entry in stats.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=300, help="submits per way (interleaved)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = PrivateRedis(Path(folder))
        try:
            run(server.url, args.jobs, Path(folder))
        finally:
            server.stop()


def run(url: str, jobs: int, folder: Path) -> None:
    namespace = f"kiln-bench-{secrets.token_hex(4)}"
    outputs = f"file://{folder / 'outputs'}"  # never written: the jobs are only submitted
    storage = StorageSettings(redis_url=url, redis_namespace=namespace, storage_url=outputs)
    settings = KilnSettings(pipelines=["tiny"])
    parts = ProcessParts(settings, storage)
    before = Submitter(parts.store, settings, celery_publisher(parts.celery_app))
    ways = {
        "published after": Intake(before, None),
        "in the creation": Intake(parts.submitter, None),
    }
    counter = redis.Redis.from_url(url)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    calls: dict[str, list[int]] = {name: [] for name in ways}
    for intake in ways.values():  # warm: scripts loaded, each queue's template built
        intake.submit(JobRequest(pipeline="tiny", prompt="warm"))
    for index in range(jobs):
        order = list(ways.items()) if index % 2 == 0 else list(reversed(ways.items()))
        for name, intake in order:
            request = JobRequest(pipeline="tiny", prompt=f"job {index}")
            before_calls = commands(counter)
            started = time.perf_counter()
            intake.submit(request)
            seconds[name].append(time.perf_counter() - started)
            calls[name].append(commands(counter) - before_calls - 1)  # less the INFO itself
    print(f"direct submits, {jobs} a way, interleaved, private Redis on loopback")
    print(f"  {'way':<18} {'p50 ms':>8} {'p90 ms':>8} {'Redis commands':>15}")
    for name in ways:
        ms = sorted(s * 1000 for s in seconds[name])
        p50, p90 = statistics.median(ms), ms[int(len(ms) * 0.9)]
        print(f"  {name:<18} {p50:8.3f} {p90:8.3f} {statistics.median(calls[name]):15.0f}")


if __name__ == "__main__":
    main()
