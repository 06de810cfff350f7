"""The overnight batch, broken on purpose: a node `kill -9`ed and Redis restarted mid-batch.

Two real `kiln worker` nodes serve the sleepy pipeline with no sleep (one step, tiny images, large
forwards) so the batch's cost is Kiln's own: feeding, leases, transitions, uploads, results. Redis
is a private server with AOF (`appendfsync always`) restarted with SIGTERM, i.e. a restart that
keeps its data. What must hold afterwards: exactly one result line per input line, every output
present in the store with the sha256 its line names (checked by downloading each one through the
CLI), and no job that reached `succeeded` twice.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchStore, FedBatch
from kiln.storage.errors import StorageError
from kiln.tasks.batches.intake import batch_job_id
from tests.e2e.cluster import SLEEPY, Cluster, WorkerProcess
from tests.e2e.services import PrivateRedis
from tests.waiting import wait_until

# The figure is 10,000 lines (`make test-soak`, about 4 minutes here); the default run
# keeps the same scenario at a size that fits the suite's time.
LINES = int(os.environ.get("KILN_BATCH_CRASH_LINES", "2000"))
FAST_PIPELINE = {"KILN_TEST_STEP_SECONDS": "0"}
BIG_FORWARDS = ["--max-batch", "64"]
RESTART_GRACE_S = 1.0  # how long Redis stays down
BATCH_SETTINGS = {
    "KILN_BATCH_WINDOW": "1024",
    "KILN_BATCH_FEED_INTERVAL_S": "0.1",
    "KILN_BATCH_FEED_CHUNK": "1000",
    "KILN_BATCH_RESULTS_FLUSH_S": "0.5",
    "KILN_BATCH_ITEM_RETENTION_S": "3600",  # the job event streams are read at the end
}


def write_lines(path: Path, count: int) -> list[str]:
    custom_ids = [f"c{n:05d}" for n in range(count)]
    line = {"prompt": "p", "width": 64, "height": 64, "steps": 1}
    path.write_text("".join(json.dumps({**line, "custom_id": c}) + "\n" for c in custom_ids))
    return custom_ids


def read_batch(batches: BatchStore, batch_id: str) -> FedBatch | None:
    """The batch, or None while Redis is restarting."""
    try:
        return batches.get_fed(batch_id)
    except (redis.ConnectionError, StorageError):
        return None


def wait_for_batch(
    batches: BatchStore,
    batch_id: str,
    done: Callable[[FedBatch], bool],
    timeout_s: float,
    alive: list[WorkerProcess],
) -> FedBatch:
    """The batch once `done`; fails at once if a node that must stay up has exited."""

    def observe() -> FedBatch | None:
        for node in alive:
            assert node.process.poll() is None, f"{node.node_id} exited:\n{node.log()}"
        return read_batch(batches, batch_id)

    batch = wait_until(
        observe, lambda seen: seen is not None and done(seen), timeout_s=timeout_s, what=batch_id
    )
    assert batch is not None
    return batch


def succeeded(count: int) -> Callable[[FedBatch], bool]:
    return lambda batch: batch.counts[JobState.SUCCEEDED] >= count


def succeeded_transitions(cluster: Cluster, job_ids: list[str]) -> Counter[str]:
    """How many times each job's event stream says it reached `succeeded`."""
    return Counter(
        job_id
        for job_id in job_ids
        for event in cluster.store.events(job_id)
        if event.type == JobState.SUCCEEDED
    )


def start_node(cluster: Cluster) -> WorkerProcess:
    return cluster.start_worker(
        f"sleepy={SLEEPY}", extra_env=FAST_PIPELINE, extra_args=BIG_FORWARDS
    )


def finish_after_restart(
    cluster: Cluster, batches: BatchStore, batch_id: str, node: WorkerProcess
) -> tuple[FedBatch, WorkerProcess | None]:
    """Wait for the batch's end; returns it and the node started if `node` exited meanwhile.

    A Redis restart under load can stop a node's `celery worker` (kombu's Redis transport, closing
    its channel, restores unacked deliveries through a connection already torn down, or a publish
    meets "Redis is loading the dataset in memory"). The node must then exit with a non-zero
    status, so that its supervisor starts it again; this test is that supervisor.
    """
    replacement = None

    def observe() -> FedBatch | None:
        nonlocal replacement
        if replacement is None and node.process.poll() is not None:
            assert node.process.returncode != 0, f"exited 0, not restarted:\n{node.log()}"
            replacement = start_node(cluster)
        if replacement is not None:
            assert replacement.process.poll() is None, replacement.log()
        return read_batch(batches, batch_id)

    batch = wait_until(
        observe, lambda seen: seen is not None and seen.final, timeout_s=600, what=batch_id
    )
    assert batch is not None
    return batch, replacement


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_large_batch_survives_a_node_kill_and_a_redis_restart(
    cluster_factory: Callable[..., Cluster], private_redis: PrivateRedis, tmp_path: Path
) -> None:
    cluster = cluster_factory(KILN_REDIS_URL=private_redis.url, **BATCH_SETTINGS)
    first, second = start_node(cluster), start_node(cluster)
    custom_ids = write_lines(tmp_path / "night.jsonl", LINES)
    started = time.monotonic()
    answer = cluster.run_cli(
        "batch", "submit", str(tmp_path / "night.jsonl"), "--pipeline", "sleepy"
    )
    assert answer.returncode == 0, answer.stderr
    batch_id = answer.stdout.strip()
    batches = BatchStore(cluster.store.redis, cluster.store.settings)

    wait_for_batch(batches, batch_id, succeeded(LINES // 5), 240, alive=[first, second])
    first.kill9()  # mid-batch: its running forward, its leases and (maybe) the feeder die
    wait_for_batch(batches, batch_id, succeeded(LINES // 2), 240, alive=[second])
    private_redis.restart(down_s=RESTART_GRACE_S)
    batch, replacement = finish_after_restart(cluster, batches, batch_id, second)
    elapsed = time.monotonic() - started

    assert batch.status == "completed", (batch, (replacement or second).log())
    out, folder = tmp_path / "results.jsonl", tmp_path / "outputs"
    answer = cluster.run_cli(
        "batch",
        "results",
        batch_id,
        "-o",
        str(out),
        "--download",
        str(folder),
        "--json",
        timeout_s=400,
    )
    assert answer.returncode == 0, answer.stderr
    report = json.loads(answer.stdout)
    assert (report["downloaded"], report["failed"]) == (LINES, [])  # every object, sha256 ok
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    results, summary = lines[:-1], lines[-1]
    assert summary["type"] == "summary"
    assert summary["batch"]["counts"]["succeeded"] == LINES
    assert len(results) == LINES
    assert sorted(r["custom_id"] for r in results) == custom_ids  # unique, none missing
    assert {r["status"] for r in results} == {"succeeded"}
    assert sum(1 for _ in folder.glob("*/*")) == LINES
    job_ids = [batch_job_id(batch_id, c) for c in custom_ids]
    assert {r["job_id"] for r in results} == set(job_ids)
    finished = succeeded_transitions(cluster, job_ids)
    assert set(finished) == set(job_ids)
    assert max(finished.values()) == 1  # no job finished twice
    restarted = "the survivor restarted by its supervisor" if replacement else "the survivor up"
    print(f"\n{LINES} lines through a kill -9 and a Redis restart in {elapsed:.1f} s ({restarted})")
