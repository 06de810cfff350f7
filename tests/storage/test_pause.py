"""Pause and resume in storage: queued and running jobs, pending pauses, retention, cancels."""

from __future__ import annotations

import json

from kiln.common.states import JobState
from kiln.common.stops import StopReason
from kiln.storage.job_store import JobStore
from kiln.storage.leases import StopRequest
from kiln.storage.preemption import PreemptionOps
from tests.storage.helpers import event_types, job_in_state, lapse_lease, new_job

QUEUE = "kiln.tiny"


def _queue_order(store: JobStore) -> list[str]:
    return list(store.redis.zrange(store.keys.queue_index(QUEUE), 0, -1))


def test_queued_job_pauses_at_once_and_resumes_at_the_back_of_its_lane(job_store: JobStore) -> None:
    first, _ = job_store.create_job(new_job(owner="key_a", queue=QUEUE))
    second, _ = job_store.create_job(new_job(owner="key_a", queue=QUEUE))
    paused = job_store.pause(first.id)
    assert paused.state == JobState.PAUSED
    assert job_store.queue_depth() == 1  # not queued, not in the backlog
    assert _queue_order(job_store) == [second.id]
    assert [r.id for r in job_store.list_jobs(state=JobState.PAUSED)[0]] == [first.id]
    assert first.id not in job_store.unpublished_jobs(0)  # no message goes out for it
    assert job_store.events(first.id)[-1].payload == {"reason": "requested"}
    assert job_store.pause(first.id) == job_store.get(first.id)  # again: nothing changes

    resumed = job_store.resume(first.id)
    assert resumed.state == JobState.QUEUED
    assert _queue_order(job_store) == [second.id, first.id]  # at the back
    assert job_store.queue_depth() == 2
    assert first.id in job_store.unpublished_jobs(0)  # the caller publishes it
    assert event_types(job_store, first.id) == ["queued", "paused", "resumed"]


def test_running_job_is_asked_then_paused_by_its_node(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    asked = job_store.pause(job_id)
    assert asked.state == JobState.RUNNING  # its node stops it at its next step
    assert job_store.stops_requested([job_id]) == {job_id: StopRequest(StopReason.PAUSED)}
    record = job_store.pause_stopped(job_id, token)
    assert record.state == JobState.PAUSED
    assert job_store.lease_owner(job_id) is None  # no lease: it holds no GPU
    assert job_id not in job_store.redis.zrange(job_store.keys.running, 0, -1)
    assert job_store.stops_requested([job_id]) == {}
    log = json.loads(job_store.redis.hget(job_store.keys.job(job_id), "attempt_log") or "[]")
    assert log[-1]["outcome"] == "paused"  # its attempt is closed, not failed
    assert record.attempts == 0  # and not counted: pausing never uses up attempts
    assert job_store.events(job_id)[-1].payload["reason"] == "pause_requested"
    assert job_store.resume(job_id).state == JobState.QUEUED


def test_resume_withdraws_a_pending_pause(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.pause(job_id)
    assert job_store.resume(job_id).state == JobState.RUNNING
    assert job_store.stops_requested([job_id]) == {}
    assert job_store.succeed(job_id, token, [{"key": "k"}], {"run_s": 1.0}).state == "succeeded"


def test_a_pending_pause_turns_a_retry_or_a_lapsed_lease_into_paused(job_store: JobStore) -> None:
    retried, token = job_in_state(job_store, JobState.RUNNING)
    job_store.pause(retried)
    record = job_store.requeue(retried, token, {"type": "Flaky", "message": "x", "retryable": True})
    assert record.state == JobState.PAUSED
    lapsed, _ = job_in_state(job_store, JobState.RUNNING)
    job_store.pause(lapsed)
    lapse_lease(job_store, lapsed)
    assert job_store.reap(lapsed)
    assert job_store.get(lapsed).state == JobState.PAUSED


def test_a_pause_replaces_a_pending_preemption_and_resume_leaves_a_preemption_alone(
    job_store: JobStore,
) -> None:
    ops = PreemptionOps(job_store.redis, job_store.settings)
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    assert ops.request_preemption(job_id, "waiting-1", cap=2, min_run_s=0.0, ttl_s=30.0)
    assert job_store.resume(job_id).state == JobState.RUNNING  # nothing to withdraw
    preempted = StopRequest(StopReason.PREEMPTED, "waiting-1")
    assert job_store.stops_requested([job_id]) == {job_id: preempted}
    assert job_store.pause(job_id).state == JobState.RUNNING
    assert job_store.stops_requested([job_id]) == {job_id: StopRequest(StopReason.PAUSED)}
    assert job_store.pause_stopped(job_id, token).state == JobState.PAUSED


def test_cancel_wins_over_pause_and_cancels_a_paused_job(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.pause(job_id)
    job_store.cancel(job_id)  # replaces the pause
    assert job_store.pause_stopped(job_id, token).state == JobState.CANCELED
    paused, _ = job_in_state(job_store, JobState.PAUSED)
    assert job_store.cancel(paused).state == JobState.CANCELED


def test_finished_jobs_are_left_as_they_are(job_store: JobStore) -> None:
    for state in (JobState.SUCCEEDED, JobState.CANCELED, JobState.FAILED, JobState.EXPIRED):
        job_id, _ = job_in_state(job_store, state)
        before = job_store.get(job_id)
        assert job_store.pause(job_id) == before
        assert job_store.resume(job_id) == before


def test_paused_past_its_retention_expires(job_store: JobStore) -> None:
    kept, _ = job_in_state(job_store, JobState.PAUSED)
    assert job_store.paused_past(3600) == []
    old, _ = job_in_state(job_store, JobState.PAUSED)
    job_store.redis.hset(job_store.keys.job(old), "paused_at", "1000.0")  # paused long ago
    assert job_store.paused_past(3600) == [old]
    record = job_store.expire_paused(old)
    assert record.state == JobState.EXPIRED
    assert job_store.events(old)[-1].payload["reason"] == "paused_retention"
    assert job_store.paused_past(3600) == []
    assert job_store.get(kept).state == JobState.PAUSED
