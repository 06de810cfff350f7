"""Operator controls, queue positions and the running cap against real `kiln worker` nodes.

Pause and resume go through `kiln admin` and the nodes' Celery remote control; a drain lets the
running job finish, takes nothing new and (with --exit) ends the worker; a purge cancels queued
jobs only; a key capped at one running job never has two running, even on a node that could
batch them.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kiln.common.request import Lane
from kiln.common.states import JobState
from kiln.storage.apikeys import ApiKeyStore
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.refusal import Caller
from kiln.tasks.queue.positions import queue_estimate
from tests.e2e.cluster import SLEEPY, Cluster, WorkerProcess
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

STEP_S = "0.05"
QUEUES = ["interactive.sleepy", "bulk.sleepy"]


@pytest.fixture(scope="module")
def cluster(module_cluster_factory: Callable[..., Cluster]) -> Iterator[Cluster]:
    made: Cluster = module_cluster_factory(
        KILN_PROGRESS_INTERVAL_S="0",
        KILN_BULK_SHARE_EVERY="4",
        KILN_PIPELINES='["sleepy", "sleepy2", "sleepy3"]',
    )
    yield made
    made.stop_all()


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> WorkerProcess:
    return cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": STEP_S})


def submit(cluster: Cluster, lane: Lane = Lane.interactive, steps: int = 2, **kw: Any) -> str:
    request = JobRequest(
        pipeline=kw.pop("pipeline", "sleepy"), prompt="x", width=64, height=64, steps=steps,
        priority=lane,
    )  # fmt: skip
    record, _ = cluster.intake.submit(request, **kw)
    return record.id


def heartbeat(cluster: Cluster, node: WorkerProcess) -> dict[str, Any]:
    return next(n for n in cluster.store.live_nodes() if n["node_id"] == node.node_id)


def admin(cluster: Cluster, *args: str) -> dict[str, Any]:
    result = cluster.run_cli("admin", *args, "--json")
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def consuming(cluster: Cluster, node: WorkerProcess) -> list[str]:
    return list(heartbeat(cluster, node)["consuming"])


def test_paused_jobs_stay_queued_in_order_and_run_once_resumed(
    cluster: Cluster, node: WorkerProcess
) -> None:
    for queue in QUEUES:
        assert admin(cluster, "pause", queue)["changed"] is True
    wait_until(lambda: consuming(cluster, node), lambda queues: queues == [])
    assert heartbeat(cluster, node)["paused_queues"] == sorted(QUEUES)
    bulk = [submit(cluster, Lane.bulk) for _ in range(2)]
    interactive = submit(cluster)
    # Two heartbeats after the submissions: the node ran its loops with the jobs queued
    seen = node.heartbeats(2)
    assert (seen["consuming"], seen["jobs_running"]) == ([], 0)
    jobs = [interactive, *bulk]
    assert [str(cluster.store.get(j).state) for j in jobs] == ["queued"] * 3
    status = cluster.run_cli("status", bulk[1], "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["queue_position"] == 2
    positions = [
        queue_estimate(cluster.store, cluster.store.get(j), cluster.settings.bulk_share_every)
        for j in jobs
    ]
    assert [p.position if p else None for p in positions] == [0, 1, 2]  # interactive first
    assert all(p is not None and p.estimated_start_s is None for p in positions)  # paused
    for queue in QUEUES:
        assert admin(cluster, "resume", queue)["changed"] is True
    for job_id in jobs:
        assert str(cluster.wait_for(job_id, timeout_s=60).state) == "succeeded"
        assert cluster.store.get(job_id).attempts == 1
    wait_until(lambda: consuming(cluster, node), lambda queues: queues == QUEUES)


def test_purge_cancels_queued_jobs_and_leaves_the_running_one(
    cluster: Cluster, node: WorkerProcess
) -> None:
    running = submit(cluster, Lane.bulk, steps=240)  # 12 s
    cluster.wait_for(running, states=["running"], timeout_s=30)
    admin(cluster, "pause", "bulk.sleepy")
    wait_until(lambda: consuming(cluster, node), lambda queues: "bulk.sleepy" not in queues)
    queued = [submit(cluster, Lane.bulk) for _ in range(3)]
    purged = admin(cluster, "purge", "bulk.sleepy")
    assert purged == {"queue": "bulk.sleepy", "canceled": 3, "job_ids": queued}
    for job_id in queued:
        events = cluster.store.events(job_id)
        assert [e.type for e in events] == ["queued", "canceled"]
        assert events[-1].payload == {"reason": "purged"}
    assert str(cluster.store.get(running).state) == "running"
    admin(cluster, "resume", "bulk.sleepy")
    done = cluster.wait_for(running, timeout_s=60)
    assert (str(done.state), done.attempts) == ("succeeded", 1)
    canary = submit(cluster, Lane.bulk)  # behind the purged jobs' messages, which are dropped
    assert str(cluster.wait_for(canary, timeout_s=60).state) == "succeeded"
    assert [cluster.completion_count(j) for j in queued] == [0, 0, 0]


@pytest.mark.usefixtures("node")
def test_a_key_capped_at_one_running_job_runs_them_one_at_a_time(cluster: Cluster) -> None:
    keys = ApiKeyStore(cluster.store.redis, cluster.storage_settings)
    key = keys.create("capped-hash", "capped", max_running=1)
    caller = Caller(key_id=key.id)
    jobs = [submit(cluster, steps=16, caller=caller) for _ in range(3)]  # the node batches 4
    seen_estimate = False
    for job_id in jobs:
        while str(cluster.store.get(job_id).state) not in ("succeeded", "failed"):
            records = [cluster.store.get(j) for j in jobs]
            assert sum(r.state == JobState.RUNNING for r in records) <= 1
            for record in records:
                estimate = queue_estimate(cluster.store, record, cluster.settings.bulk_share_every)
                seen_estimate |= estimate is not None and estimate.estimated_start_s is not None
            time.sleep(0.05)
    records = [cluster.store.get(j) for j in jobs]
    assert [str(r.state) for r in records] == ["succeeded"] * 3
    assert [r.attempts for r in records] == [1, 1, 1]  # a deferred start is no attempt
    spans = sorted((r.started_at or 0.0, r.finished_at or 0.0) for r in records)
    assert all(later[0] >= earlier[1] for earlier, later in itertools.pairwise(spans))
    assert seen_estimate  # once runs had finished, the waiting ones had an expected start
    assert cluster.store.redis.hgetall(cluster.store.keys.owner_running) == {}


def test_drain_finishes_the_running_job_takes_no_new_one_and_exits(cluster: Cluster) -> None:
    drained = cluster.start_worker(
        f"sleepy2={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": STEP_S}
    )
    long_job = submit(cluster, steps=60, pipeline="sleepy2")
    cluster.wait_for(long_job, states=["running"], timeout_s=30)
    request = admin(cluster, "drain", drained.node_id, "--exit")
    assert request == {"node_id": drained.node_id, "drain_requested": True, "exit": True}
    wait_until(lambda: heartbeat(cluster, drained), lambda info: info["draining"] is True)
    late = submit(cluster, pipeline="sleepy2")
    done = cluster.wait_for(long_job, timeout_s=60)
    assert (str(done.state), done.attempts, done.error) == ("succeeded", 1, None)
    assert drained.process.wait(60) == 0
    assert cluster.store.drain_requests() == {}  # withdrawn by the node on its way out
    assert [e.type for e in cluster.store.events(late)] == ["queued"]  # never started there
    successor = cluster.start_worker(
        f"sleepy2={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": STEP_S}
    )
    assert str(cluster.wait_for(late, timeout_s=60).state) == "succeeded"  # its message waited
    successor.stop()


def test_positions_predict_the_order_jobs_start_in(cluster: Cluster) -> None:
    bulk = [submit(cluster, Lane.bulk, steps=1, pipeline="sleepy3") for _ in range(4)]
    interactive = [submit(cluster, steps=1, pipeline="sleepy3") for _ in range(8)]
    every = cluster.settings.bulk_share_every
    predicted = {
        job_id: queue_estimate(cluster.store, cluster.store.get(job_id), every)
        for job_id in bulk + interactive
    }
    queues = ["interactive.sleepy3", "bulk.sleepy3"]
    for queue in queues:
        admin(cluster, "pause", queue)
    worker = cluster.start_worker(  # one job at a time: the start order is the consumption order
        f"sleepy3={SLEEPY}",
        extra_env={"KILN_TEST_STEP_SECONDS": "0.01"},
        extra_args=["--concurrency", "1", "--max-batch", "1"],
    )
    # started while both its queues are paused: two heartbeats on, it consumes neither
    seen = worker.heartbeats(2)
    assert (seen["consuming"], seen["jobs_running"]) == ([], 0)
    assert all(str(cluster.store.get(j).state) == "queued" for j in bulk + interactive)
    # both at once (one HDEL): resumed one by one, the first could run jobs before the other
    cluster.store.redis.hdel(cluster.store.keys.paused_queues, *queues)
    records = [cluster.wait_for(job_id, timeout_s=120) for job_id in bulk + interactive]
    started = [r.id for r in sorted(records, key=lambda r: r.started_at or 0.0)]
    positions = [predicted[job_id] for job_id in started]
    assert [p.position if p else None for p in positions] == list(range(12))
    worker.stop()
