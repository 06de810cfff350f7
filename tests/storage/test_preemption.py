"""Priority preemption in storage: the guarded request, and the preempted run's requeue.

A preempted job goes back to the head of its lane (its queue index entry and its message before
every other), its attempt not counted, its preemptions recorded; the request's guard (cap, least
run, one claim per waiting job, no stop pending) holds in the script. The request is the job's one
stop request (storage/leases.py): a cancel or a pause replaces it, and it ends with the run it
asked to stop, however that run ends.
"""

from __future__ import annotations

from typing import Any

import pytest

from kiln.common.states import JobState
from kiln.common.stops import StopReason
from kiln.storage.errors import StaleLease
from kiln.storage.job_store import JobStore
from kiln.storage.leases import StopRequest
from kiln.storage.preemption import PreemptionOps
from tests.storage.helpers import WORKER, event_types, lapse_lease, lease_token, new_job

BULK = "bulk.tiny"
PREEMPTED_FOR_1 = StopRequest(StopReason.PREEMPTED, "waiting-1")


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
    assert job_store.stops_requested([job_id]) == {}
    assert ops.request_preemption(job_id, "waiting-1", **ask)
    assert job_store.stops_requested([job_id]) == {job_id: PREEMPTED_FOR_1}
    # asked once: by another process for the same waiting job, or of the same job for another
    other, _ = _running_bulk(job_store)
    assert not ops.request_preemption(other, "waiting-1", **ask)
    assert not ops.request_preemption(job_id, "waiting-2", **ask)
    ops.requeue_preempted(job_id, token, "waiting-1")
    assert job_store.stops_requested([job_id]) == {}  # the requeue ends the request
    # its cap (1) reached: never again, whatever waits
    token = job_store.acquire_lease(job_id, WORKER)
    job_store.start(job_id, token)
    assert not ops.request_preemption(job_id, "waiting-3", **ask)
    # a job with a stop pending is not preempted, and its stop stays as it was asked
    job_store.cancel(other)
    assert not ops.request_preemption(other, "waiting-4", **ask)
    assert job_store.stops_requested([other]) == {other: StopRequest(StopReason.CANCELED)}
    paused, _ = _running_bulk(job_store)
    job_store.pause(paused)
    assert not ops.request_preemption(paused, "waiting-6", **ask)
    assert job_store.stops_requested([paused]) == {paused: StopRequest(StopReason.PAUSED)}
    # a queued job is not preempted
    assert not ops.request_preemption(_queued_bulk(job_store), "waiting-5", **ask)


def test_a_cancel_or_a_pause_replaces_a_pending_preemption_and_ends_the_run_so(
    job_store: JobStore, ops: PreemptionOps
) -> None:
    ask: dict[str, Any] = {"cap": 2, "min_run_s": 0.0, "ttl_s": 30.0}
    canceled, cancel_token = _running_bulk(job_store)
    paused, pause_token = _running_bulk(job_store)
    for job_id in (canceled, paused):
        assert ops.request_preemption(job_id, "waiting-1" if job_id == canceled else "w-2", **ask)
    job_store.cancel(canceled)
    job_store.pause(paused)
    assert job_store.stops_requested([canceled, paused]) == {
        canceled: StopRequest(StopReason.CANCELED),
        paused: StopRequest(StopReason.PAUSED),
    }
    # a node that stopped either for the preemption already ends it as the later ask says
    assert ops.requeue_preempted(canceled, cancel_token, "waiting-1").state == JobState.CANCELED
    assert ops.requeue_preempted(paused, pause_token, "w-2").state == JobState.PAUSED
    assert ops.preemption_count(canceled)[0] == ops.preemption_count(paused)[0] == 0
    assert job_store.stops_requested([canceled, paused]) == {}


def test_a_pending_preemption_ends_with_the_run_it_asked_to_stop(
    job_store: JobStore, ops: PreemptionOps
) -> None:
    ask: dict[str, Any] = {"cap": 2, "min_run_s": 0.0, "ttl_s": 30.0}
    # a retry (or a drain's hand-back) before its node stopped it: the next run is not stopped
    job_id, token = _running_bulk(job_store)
    assert ops.request_preemption(job_id, "waiting-1", **ask)
    error = {"type": "Flaky", "message": "x", "retryable": True}
    assert job_store.requeue(job_id, token, error).state == JobState.QUEUED  # not a cancel
    assert job_store.stops_requested([job_id]) == {}
    # a lapsed lease: reaped back to the queue, no request left either
    reaped, _ = _running_bulk(job_store)
    assert ops.request_preemption(reaped, "waiting-2", **ask)
    lapse_lease(job_store, reaped)
    assert job_store.reap(reaped)
    assert job_store.get(reaped).state == JobState.QUEUED
    assert job_store.stops_requested([reaped]) == {}
    # an end of its own: succeeded, the request gone with the run
    done, done_token = _running_bulk(job_store)
    assert ops.request_preemption(done, "waiting-3", **ask)
    assert job_store.succeed(done, done_token, [{"key": "k"}], {"run_s": 1.0}).state == "succeeded"
    assert job_store.stops_requested([done]) == {}


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
