"""Priority preemption in storage: the guarded request, and the preempted run's requeue.

A preempted job goes back to the head of its lane (its queue index entry and its message before
every other), its attempt not counted, its preemptions recorded; the request's guard (cap, least
run, one claim per waiting job, no stop pending) holds in the script.
"""

from __future__ import annotations

from typing import Any

import pytest

from kiln.common.states import JobState
from kiln.storage.errors import StaleLease
from kiln.storage.job_store import JobStore
from kiln.storage.preemption import PreemptionOps
from tests.storage.helpers import WORKER, event_types, lease_token, new_job

BULK = "bulk.tiny"


@pytest.fixture
def ops(job_store: JobStore) -> PreemptionOps:
    return PreemptionOps(job_store.redis, job_store.settings)


def _running_bulk(store: JobStore) -> tuple[str, int]:
    record, _ = store.create_job(new_job(lane="bulk", queue=BULK))
    token = store.acquire_lease(record.id, f"{WORKER}/delivery-1")
    store.start(record.id, token)
    return record.id, token


def _queued_bulk(store: JobStore) -> str:
    record, _ = store.create_job(new_job(lane="bulk", queue=BULK))
    return record.id


def test_a_preempted_job_is_queued_at_the_head_of_its_lane_its_attempt_not_counted(
    job_store: JobStore, ops: PreemptionOps
) -> None:
    first = _queued_bulk(job_store)
    job_id, token = _running_bulk(job_store)
    second = _queued_bulk(job_store)
    assert job_store.get(job_id).attempts == 1
    list_key = f"{job_store.settings.redis_namespace}:test-list"
    job_store.redis.delete(list_key)
    job_store.redis.lpush(list_key, "older")  # kombu pushes on the left, pops on the right

    record = ops.requeue_preempted(job_id, token, "waiting-1", (list_key, "its message"))

    assert record.state == JobState.QUEUED
    assert record.attempts == 0  # its next start counts attempt 1 again
    assert record.published
    assert ops.preemption_count(job_id)[0] == 1
    index = job_store.redis.zrange(job_store.keys.queue_index(BULK), 0, -1)
    assert index == [job_id, first, second]
    assert job_store.redis.rpop(list_key) == "its message"  # the next fetch pops it first
    assert event_types(job_store, job_id)[-2:] == ["queued", "preempted"]
    events = job_store.events(job_id, count=100)
    assert events[-2].payload["reason"] == "preempted"
    assert events[-1].payload == {"for_job": "waiting-1", "preemptions": 1}
    # its next attempt counts as attempt 1, and a second preemption counts 2
    token = job_store.acquire_lease(job_id, WORKER)
    assert job_store.start(job_id, token).attempts == 1
    record = ops.requeue_preempted(job_id, token, None)
    assert record.attempts == 0
    assert not record.published  # no message given: the caller publishes it
    assert ops.preemption_count(job_id)[0] == 2


def test_the_requeue_is_fenced_by_the_lease(job_store: JobStore, ops: PreemptionOps) -> None:
    job_id, token = _running_bulk(job_store)
    with pytest.raises(StaleLease):
        ops.requeue_preempted(job_id, token + 1, None)
    assert job_store.get(job_id).state == JobState.RUNNING


def test_a_cancel_pending_ends_a_preempted_run_canceled(
    job_store: JobStore, ops: PreemptionOps
) -> None:
    job_id, token = _running_bulk(job_store)
    job_store.cancel(job_id)
    record = ops.requeue_preempted(job_id, token, None)
    assert record.state == JobState.CANCELED
    assert ops.preemption_count(job_id)[0] == 0


def test_the_request_is_guarded(job_store: JobStore, ops: PreemptionOps) -> None:
    job_id, token = _running_bulk(job_store)
    ask: dict[str, Any] = {"cap": 1, "min_run_s": 0.0, "ttl_s": 30.0}
    # a run shorter than the least run is left alone
    assert not ops.request_preemption(job_id, "waiting-1", cap=1, min_run_s=3600.0, ttl_s=30.0)
    assert ops.preemptions_requested([job_id]) == {}
    assert ops.request_preemption(job_id, "waiting-1", **ask)
    assert ops.preemptions_requested([job_id]) == {job_id: "waiting-1"}
    # asked once: by another process for the same waiting job, or of the same job for another
    other, _ = _running_bulk(job_store)
    assert not ops.request_preemption(other, "waiting-1", **ask)
    assert not ops.request_preemption(job_id, "waiting-2", **ask)
    ops.requeue_preempted(job_id, token, "waiting-1")
    assert ops.preemptions_requested([job_id]) == {}  # the requeue ends the request
    # its cap (1) reached: never again, whatever waits
    token = job_store.acquire_lease(job_id, WORKER)
    job_store.start(job_id, token)
    assert not ops.request_preemption(job_id, "waiting-3", **ask)
    # a job with a stop pending is not preempted
    job_store.cancel(other)
    assert not ops.request_preemption(other, "waiting-4", **ask)
    # a queued job is not preempted
    assert not ops.request_preemption(_queued_bulk(job_store), "waiting-5", **ask)


def test_waiting_and_running_reads(job_store: JobStore, ops: PreemptionOps) -> None:
    record, _ = job_store.create_job(new_job(lane="interactive", queue="interactive.tiny"))
    held, _ = job_store.create_job(new_job(lane="interactive", queue="interactive.tiny"))
    job_store.hold(held.id, "node-a/delivery-7", "node-a", 0)
    waiting = ops.waiting("interactive.tiny", 10)
    assert [(w.job_id, w.holder) for w in waiting] == [(record.id, None), (held.id, "node-a")]
    job_id, token = _running_bulk(job_store)
    assert lease_token(job_store, job_id) == token
    (running,) = ops.running_in([BULK])
    assert (running.job_id, running.node, running.preemptions) == (job_id, WORKER, 0)
    assert ops.running_in(["interactive.tiny"]) == []
