"""Leases: increasing fencing tokens, TTL expiry, renewal, release, the reaper query, reap."""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.common.stops import StopReason
from kiln.storage.errors import JobNotFound, LeaseHeld, StaleLease
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.leases import Renewal, StopRequest, read_stop
from kiln.storage.preemption import PreemptionOps
from tests.storage.helpers import WORKER, event_types, job_in_state, lapse_lease
from tests.waiting import wait_until


def test_tokens_strictly_increase(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    tokens = [job_store.acquire_lease(job_id, WORKER)]
    tokens.append(job_store.acquire_lease(job_id, WORKER))
    job_store.release_lease(job_id, tokens[-1])
    tokens.append(job_store.acquire_lease(job_id, "worker-b"))
    assert tokens == sorted(set(tokens))
    assert tokens[0] >= 1


def test_live_lease_of_another_owner_refused(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    job_store.acquire_lease(job_id, WORKER)
    with pytest.raises(LeaseHeld):
        job_store.acquire_lease(job_id, "worker-b")
    assert job_store.lease_owner(job_id) == WORKER


def test_acquire_unknown_job(job_store: JobStore) -> None:
    with pytest.raises(JobNotFound):
        job_store.acquire_lease("nope", WORKER)


def test_lease_expires_then_reaped(job_store: JobStore) -> None:
    store = job_store
    job_id, token = job_in_state(store, JobState.RUNNING)
    assert store.reap(job_id) is False  # lease still live
    lapse_lease(store, job_id)
    wait_until(lambda: store.lease_owner(job_id), lambda owner: owner is None, what="lease lapsed")
    new = store.acquire_lease(job_id, "worker-b")  # another node may take it over
    assert new > token
    with pytest.raises(StaleLease):
        store.succeed(job_id, token, [], {})
    store.release_lease(job_id, new)
    assert store.reap(job_id) is True
    record = store.get(job_id)
    assert record.state == JobState.QUEUED
    assert not record.published
    assert job_id not in store.reap_lapsed()  # queued now: nothing for the reaper
    assert job_id in store.unpublished_jobs(0)
    assert event_types(store, job_id) == ["queued", "running", "queued"]
    assert store.events(job_id)[-1].payload["reason"] == "lease_expired"  # and its accounting
    assert store.queue_depth() == 1
    assert store.reap(job_id) is False  # not running any more


def test_renewal_rearms_the_ttl(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    lease_key = job_store.keys.lease(job_id)
    job_store.redis.pexpire(lease_key, 50)  # as if most of the TTL had passed
    assert job_store.renew_lease(job_id, token) is Renewal.RENEWED
    assert job_store.redis.pttl(lease_key) > 1000
    assert job_id not in job_store.reap_lapsed()
    assert job_store.get(job_id).state == JobState.RUNNING


def test_renewal_after_expiry_while_still_current(job_store: JobStore) -> None:
    store = job_store
    job_id, token = job_in_state(store, JobState.RUNNING)
    lapse_lease(store, job_id)
    wait_until(lambda: store.lease_owner(job_id), lambda owner: owner is None, what="lease lapsed")
    # nobody took it over and the reaper did not run: the holder may carry on
    assert store.renew_lease(job_id, token) is Renewal.RENEWED
    assert store.lease_owner(job_id) == WORKER


def test_renewal_with_stale_token_fails(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.release_lease(job_id, token)
    job_store.acquire_lease(job_id, "worker-b")
    assert job_store.renew_lease(job_id, token) is Renewal.LOST
    assert job_store.lease_owner(job_id) == "worker-b"


def test_renewal_stops_at_terminal_state(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.succeed(job_id, token, [], {})
    # the holder's own success: ended, not lost (no warning, no renewal-failure count)
    assert job_store.renew_lease(job_id, token) is Renewal.ENDED
    assert job_store.lease_owner(job_id) is None


def test_release_of_running_job_makes_it_reapable(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.release_lease(job_id, token)
    assert job_store.lease_owner(job_id) is None
    assert job_store.reap_lapsed() == [job_id]
    assert job_store.get(job_id).state == JobState.QUEUED
    assert job_store.reap(job_id) is False  # moved already


def test_one_reaper_pass_moves_every_lapsed_job_and_no_live_one(job_store: JobStore) -> None:
    lapsed, lapsed_token = job_in_state(job_store, JobState.RUNNING)
    canceled, canceled_token = job_in_state(job_store, JobState.RUNNING)
    live, _ = job_in_state(job_store, JobState.RUNNING)
    job_store.cancel(canceled)  # a cancel pending: its lapse ends it canceled
    for job_id, token in ((lapsed, lapsed_token), (canceled, canceled_token)):
        job_store.release_lease(job_id, token)
    assert sorted(job_store.reap_lapsed()) == sorted([lapsed, canceled])
    states = [job_store.get(job_id).state for job_id in (lapsed, canceled, live)]
    assert states == [JobState.QUEUED, JobState.CANCELED, JobState.RUNNING]
    assert job_store.events(lapsed)[-1].payload["reason"] == "lease_expired"
    assert job_id_not_published(job_store, lapsed)
    assert job_store.reap_lapsed() == []  # applied once


def test_stale_release_is_a_no_op(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    new = job_store.acquire_lease(job_id, WORKER)
    job_store.release_lease(job_id, token)
    assert job_store.lease_owner(job_id) == WORKER
    assert job_store.renew_lease(job_id, new) is Renewal.RENEWED


def test_reap_with_pending_cancel_cancels(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.cancel(job_id)
    job_store.release_lease(job_id, token)
    assert job_store.reap(job_id) is True
    assert job_store.get(job_id).state == JobState.CANCELED
    assert job_store.queue_depth() == 0


def test_stops_requested_reads_many_requests_in_one_call(job_store: JobStore) -> None:
    ids = []
    for index in range(3):
        job_id = f"many{index}"
        job_store.create_job(NewJob(id=job_id, request={"pipeline": "tiny"}))
        job_store.start(job_id, job_store.acquire_lease(job_id, f"w{index}"))
        ids.append(job_id)
    assert job_store.stops_requested(ids) == {}
    job_store.cancel("many1")
    job_store.pause("many2")
    preemption = PreemptionOps(job_store.redis, job_store.settings)
    assert preemption.request_preemption("many0", "waiting-1", cap=2, min_run_s=0.0, ttl_s=30.0)
    assert job_store.stops_requested(ids) == {
        "many0": StopRequest(StopReason.PREEMPTED, "waiting-1"),
        "many1": StopRequest(StopReason.CANCELED),
        "many2": StopRequest(StopReason.PAUSED),
    }
    assert job_store.cancel_requested("many1")
    assert not job_store.cancel_requested("many2")  # a pause is no cancel
    assert not job_store.cancel_requested("many0")  # nor is a preemption
    assert job_store.stop_requested("many2") == StopRequest(StopReason.PAUSED)
    job_store.cancel("many2")  # a cancel replaces a pending pause
    assert job_store.stops_requested(ids)["many2"] == StopRequest(StopReason.CANCELED)
    job_store.pause("many1")  # never the reverse
    assert job_store.stops_requested(ids)["many1"] == StopRequest(StopReason.CANCELED)
    job_store.pause("many0")  # a pause replaces a pending preemption
    assert job_store.stops_requested(ids)["many0"] == StopRequest(StopReason.PAUSED)
    job_store.cancel("many0")  # and a cancel replaces either
    assert job_store.stops_requested(ids)["many0"] == StopRequest(StopReason.CANCELED)
    assert job_store.stops_requested([]) == {}


def test_a_stop_request_of_the_release_before_reads_as_it_was_written() -> None:
    # a cancel was '1' and a pause 'pause'; any other value was read as a cancel, and still is
    assert read_stop("1") == StopRequest(StopReason.CANCELED)
    assert read_stop("pause") == StopRequest(StopReason.PAUSED)
    assert read_stop("anything") == StopRequest(StopReason.CANCELED)
    assert read_stop("preempt:job-1") == StopRequest(StopReason.PREEMPTED, "job-1")


def job_id_not_published(store: JobStore, job_id: str) -> bool:
    """A reaped job waits for the reaper's publish (listed unpublished)."""
    return not store.get(job_id).published and job_id in store.unpublished_jobs(0)
