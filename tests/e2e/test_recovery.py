"""Crash and recovery: nothing lost, nothing run twice (docs/operations.md §5).

These start real `celery worker` node processes with a sleepy fixture pipeline and kill or stop
parts of the system mid-job. They are marked slow: `make test-slow` and CI run them, `make test`
leaves them out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from kiln.storage.dead_letters import DeadLetterStore
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.app import transport_options
from kiln.tasks.queue.submit import Submitter
from tests.e2e.cluster import SLEEPY, Cluster, WorkerProcess
from tests.e2e.services import FlakyProxy, PrivateRedis
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLEEPY_PIPELINE = f"sleepy={SLEEPY}"


def output_keys_in_bucket(cluster: Cluster, job_id: str) -> list[str]:
    """Every object under the job's folder, straight from the store's bucket listing."""
    return sorted(cluster.list_output_keys(job_id))


def assert_one_output_set(cluster: Cluster, job_id: str, num_outputs: int) -> None:
    record = cluster.store.get(job_id)
    assert str(record.state) == "succeeded", record.error
    keys = sorted(o["key"] for o in record.outputs)
    assert len(keys) == num_outputs
    assert output_keys_in_bucket(cluster, job_id) == keys
    assert cluster.completion_count(job_id) == 1


def test_rank_killed_mid_job_is_retried_and_succeeds_once(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    worker = cluster.start_worker(
        SLEEPY_PIPELINE, devices="cpu:2", extra_env={"KILN_TEST_STEP_SECONDS": "0.2"}
    )
    job_id = cluster.submit(
        pipeline="sleepy", prompt="x", width=64, height=64, steps=15, num_outputs=2
    )
    cluster.wait_for_step(job_id, 2)
    ranks = worker.rank_pids()
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    record = cluster.wait_for(job_id, timeout_s=120)
    assert record.attempts == 2
    assert_one_output_set(cluster, job_id, num_outputs=2)
    retries = [e for e in cluster.store.events(job_id) if e.type == "queued" and e.seq > 1]
    assert [e.payload["error"]["type"] for e in retries] == ["WorkerGroupDied"]


def test_node_killed_mid_job_finishes_on_the_other_node(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    step_env = {"KILN_TEST_STEP_SECONDS": "0.2"}
    first = cluster.start_worker(SLEEPY_PIPELINE, extra_env=step_env)
    second = cluster.start_worker(SLEEPY_PIPELINE, extra_env=step_env)
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=20)
    cluster.wait_for_step(job_id, 3)
    holder = (cluster.store.lease_owner(job_id) or "").split("/")[0]  # owner = node/delivery
    assert holder in (first.node_id, second.node_id)
    victim = first if holder == first.node_id else second
    ranks = list(victim.rank_pids().values())
    assert ranks
    killed_at = time.monotonic()
    victim.kill9()
    record = cluster.wait_for(job_id, timeout_s=60)
    recovered_s = time.monotonic() - killed_at
    assert recovered_s <= 45, f"recovery took {recovered_s:.1f}s"
    assert record.attempts == 2
    assert_one_output_set(cluster, job_id, num_outputs=1)
    survivor = second if victim is first else first
    assert any(e.payload.get("node_id") == survivor.node_id for e in cluster.store.events(job_id))
    wait_until(
        lambda: [pid for pid in ranks if os.path.exists(f"/proc/{pid}")],
        lambda left: not left,
        timeout_s=10,
        what="ranks gone with their node",
    )


def test_sigterm_with_grace_finishes_the_running_job(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    worker = cluster.start_worker(
        SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.1", "KILN_DRAIN_GRACE_S": "60"}
    )
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=20)
    cluster.wait_for_step(job_id, 2)
    assert worker.terminate(timeout_s=90) == 0
    record = cluster.store.get(job_id)
    assert str(record.state) == "succeeded"
    assert_one_output_set(cluster, job_id, num_outputs=1)


def test_sigterm_past_grace_hands_the_job_back(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory()
    worker = cluster.start_worker(
        SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.2", "KILN_DRAIN_GRACE_S": "0.5"}
    )
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=100)
    cluster.wait_for_step(job_id, 2)
    worker.terminate(timeout_s=60)
    record = cluster.store.get(job_id)
    assert str(record.state) == "queued", "a job past the grace must go back to the queue"
    assert record.error
    assert record.error["type"] == "handed_back"
    cluster.start_worker(SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    cluster.wait_for(job_id, timeout_s=60)
    assert_one_output_set(cluster, job_id, num_outputs=1)


def test_job_longer_than_visibility_timeout_runs_once(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(KILN_VISIBILITY_TIMEOUT_S="2")
    worker = cluster.start_worker(SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.5"})
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=24)
    cluster.wait_for(job_id, timeout_s=120)
    assert_one_output_set(cluster, job_id, num_outputs=1)
    assert cluster.store.get(job_id).attempts == 1
    # The redelivery really happened, and the lease turned it away.
    assert f"job {job_id} delivered again while leased" in worker.output()


def test_a_job_that_breaks_its_group_twice_is_dead_lettered_and_never_runs_again(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(KILN_MAX_ATTEMPTS="3", KILN_RETRY_BACKOFF_S="0.2")
    worker = cluster.start_worker(SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    job_id = cluster.submit(pipeline="sleepy", prompt="poison", width=64, height=64, steps=4)
    record = cluster.wait_for(job_id, timeout_s=180)
    assert str(record.state) == "failed"
    # attempts were left (3), but a second group death makes the job poison: no third run
    assert record.attempts == 2
    assert record.error is not None
    assert record.error["retryable"] is False
    assert record.error["type"] == "WorkerGroupDied"
    assert record.error["poison"] == "group_broken_twice"
    events_then = len(cluster.store.events(job_id))
    # Two heartbeats on, the node ran its loops and holds no message of the job (a retry's
    # countdown would be listed): nothing is left that could run it again.
    assert worker.heartbeats(2)["jobs_running"] == 0
    held = cluster.store.redis.hget(cluster.store.keys.held_deliveries, worker.node_id) or ""
    assert job_id not in held
    assert len(cluster.store.events(job_id)) == events_then, "a failed job must not run again"
    running_events = [e for e in cluster.store.events(job_id) if e.type == "running"]
    assert len(running_events) == 2
    # its dead letter holds both attempts: the node, the times, each one's group death
    letter = DeadLetterStore(cluster.store.redis, cluster.store.settings).get(job_id)
    assert letter is not None
    assert letter.poison == "group_broken_twice"
    assert letter.request["prompt"] == "poison"
    first, second = letter.attempt_log
    for number, attempt in enumerate((first, second), start=1):
        assert attempt["attempt"] == number
        assert attempt["node"] == worker.node_id
        assert attempt["started_at"] <= attempt["ended_at"]
        assert attempt["error"]["type"] == "WorkerGroupDied"
    assert (first["outcome"], second["outcome"]) == ("queued", "failed")
    assert second["error"]["poison"] == "group_broken_twice"


def test_object_store_unreachable_during_upload_retries_then_succeeds(
    cluster_factory: Callable[..., Cluster], s3_proxy: FlakyProxy
) -> None:
    cluster = cluster_factory()
    cluster.start_worker(
        SLEEPY_PIPELINE,
        extra_env={
            "KILN_TEST_STEP_SECONDS": "0.05",
            "KILN_S3_ENDPOINT_URL": s3_proxy.url,
            "KILN_OBJECT_STORE_MAX_ATTEMPTS": "2",
        },
    )
    s3_proxy.down()
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=4)
    wait_until(
        lambda: cluster.store.get(job_id).progress or {},
        lambda progress: progress.get("stage") == "uploading",
        timeout_s=60,
    )
    # The node tried the store three times over (each try: KILN_OBJECT_STORE_MAX_ATTEMPTS
    # connections refused) and holds on to the job
    refused = s3_proxy.refused
    wait_until(lambda: s3_proxy.refused, lambda now: now >= refused + 3 * 2)
    record = cluster.store.get(job_id)
    assert str(record.state) == "running"
    assert record.outputs == []
    assert s3_proxy.refused > 0
    s3_proxy.up()
    cluster.wait_for(job_id, timeout_s=120)
    assert_one_output_set(cluster, job_id, num_outputs=1)


def test_redis_restart_mid_run_loses_no_job(
    cluster_factory: Callable[..., Cluster], private_redis: PrivateRedis
) -> None:
    cluster = cluster_factory(KILN_REDIS_URL=private_redis.url)
    cluster.start_worker(SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.1"})
    job_ids = [
        cluster.submit(pipeline="sleepy", prompt=f"p{i}", width=64, height=64, steps=10)
        for i in range(6)
    ]
    cluster.wait_for_step(job_ids[0], 2)
    private_redis.restart()
    for job_id in job_ids:
        record = cluster.wait_for(job_id, timeout_s=180)
        assert str(record.state) == "succeeded", (job_id, record.error)
        assert cluster.completion_count(job_id) >= 1


HOLDING_NODE = {"KILN_TEST_STEP_SECONDS": "0.01", "KILN_LEASE_BUSY_DELAY_S": "600"}


def hold_a_countdown(cluster: Cluster, holder: WorkerProcess) -> tuple[str, int]:
    """A queued job whose message `holder` holds as a 600 s countdown; (job id, busy lease token).

    A node holds a job's message without a lease on it: here a countdown (the lease was busy
    when it was delivered), as in every moment between a delivery and its lease.
    """
    unpublished = Submitter(cluster.store, cluster.settings, lambda *_: None)
    record, _ = Intake(unpublished, None).submit(
        JobRequest(pipeline="sleepy", prompt="x", width=64, height=64, steps=2)
    )
    ghost = cluster.store.acquire_lease(record.id, "ghost/1")
    cluster.submitter.publish(record)  # delivered to the holder: lease busy, held for 600 s
    held = cluster.store.keys.held_deliveries
    options = transport_options(cluster.settings, cluster.storage_settings.redis_namespace)
    unacked = f"{options['global_keyprefix']}unacked"

    def holds_the_countdown() -> bool:
        # listed, and the delivery kombu records is the countdown, not the first message (whose
        # lease attempt might otherwise come after the lease's release and start the job there)
        listed = record.id in (cluster.store.redis.hget(held, holder.node_id) or "")
        deliveries = [v for v in cluster.store.redis.hvals(unacked) if record.id in v]
        return listed and len(deliveries) == 1 and '"eta": null' not in deliveries[0]

    wait_until(holds_the_countdown, timeout_s=60, what=f"the countdown held by {holder.node_id}")
    return record.id, ghost


def test_node_killed_holding_a_message_does_not_stall_its_job(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # Killed holding it, the broker would give the message back only after its visibility
    # timeout (an hour).
    cluster = cluster_factory()
    holder = cluster.start_worker(SLEEPY_PIPELINE, extra_env=HOLDING_NODE)
    job_id, ghost = hold_a_countdown(cluster, holder)
    cluster.store.release_lease(job_id, ghost)
    holder.kill9()
    cluster.start_worker(SLEEPY_PIPELINE, extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    # far below the 600 s countdown and the 3600 s visibility timeout: the sweeper's doing
    finished = cluster.wait_for(job_id, timeout_s=60)
    assert str(finished.state) == "succeeded", finished.error
    assert finished.attempts == 1
    assert_one_output_set(cluster, job_id, num_outputs=1)


def test_a_message_held_across_a_broker_reconnect_does_not_stall_its_job(
    cluster_factory: Callable[..., Cluster], private_redis: PrivateRedis
) -> None:
    # Redis restarts while the node holds the countdown: Celery drops what it held unstarted as
    # its broker connection breaks, and kombu gives it back (if at all) through that connection;
    # given back, its redelivery meets the busy lease and waits 600 s more. At its reconnect the
    # node owes the job a message (tasks/node/held.py), published once the lease is free. The
    # node lives through it (kombu's close after a broken connection stopped its consumer:
    # tasks/queue/kombu_redis.py, item 5).
    cluster = cluster_factory(KILN_REDIS_URL=private_redis.url)
    holder = cluster.start_worker(SLEEPY_PIPELINE, extra_env=HOLDING_NODE)
    job_id, ghost = hold_a_countdown(cluster, holder)
    private_redis.restart()

    def consuming_again() -> bool:  # the node's consumer waits on its queues again
        assert holder.process.poll() is None, f"the node exited:\n{holder.log()}"
        return any(c["cmd"] == "brpop" for c in cluster.store.redis.client_list())

    wait_until(consuming_again, timeout_s=60, what=f"{holder.node_id} consuming again")
    cluster.store.release_lease(job_id, ghost)  # the job's holder let it go unstarted
    finished = cluster.wait_for(job_id, timeout_s=60)  # far below the 600 s countdown
    assert str(finished.state) == "succeeded", finished.error
    assert finished.attempts == 1
    assert_one_output_set(cluster, job_id, num_outputs=1)
    assert holder.process.poll() is None, holder.log()  # it ran the job too: the only node
