"""acquire_and_start: lease + queued -> running in one script, with acquire's and start's rules."""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.storage.errors import IllegalTransition, JobNotFound, LeaseHeld, QuotaExceeded, StaleLease
from kiln.storage.job_store import JobStore
from kiln.storage.leases import Renewal
from tests.storage.helpers import WORKER, event_types, job_in_state

pytestmark = pytest.mark.every_redis  # refusals are script errors: 6.2 must pass them on too


def lease_token(store: JobStore, job_id: str) -> int:
    """The token the record holds (0: none), as the fenced scripts read it."""
    return int(store.redis.hget(store.keys.job(job_id), "lease_token") or 0)


def test_leases_and_starts_in_one_call(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    token, record = job_store.acquire_and_start(job_id, WORKER, node_id="node-1")
    assert record.state == JobState.RUNNING
    assert (record.attempts, lease_token(job_store, job_id)) == (1, token)
    assert job_store.lease_owner(job_id) == WORKER
    assert job_store.queue_depth() == 0
    assert event_types(job_store, job_id)[-1] == "running"
    payload = job_store.events(job_id, count=10)[-1].payload
    assert (payload["node_id"], payload["owner"], payload["attempts"]) == ("node-1", WORKER, 1)
    # the lease is renewable with the token and the running set holds the job (the reaper's view)
    assert job_store.renew_lease(job_id, token) is Renewal.RENEWED
    assert job_id not in job_store.expired_leases()


def test_token_fences_every_earlier_one(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    old = job_store.acquire_lease(job_id, WORKER)
    token, _ = job_store.acquire_and_start(job_id, WORKER)
    assert token > old
    with pytest.raises(StaleLease):
        job_store.set_progress(job_id, old, {"step": 1})
    job_store.succeed(job_id, token, [{"key": "k"}], {"run_s": 0.1})
    assert job_store.get(job_id).state == JobState.SUCCEEDED


def test_live_lease_of_another_owner_refused_unchanged(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    held = job_store.acquire_lease(job_id, "worker-b")
    with pytest.raises(LeaseHeld):
        job_store.acquire_and_start(job_id, WORKER)
    after = job_store.get(job_id)
    assert (after.state, lease_token(job_store, job_id), after.attempts) == (
        JobState.QUEUED,
        held,
        0,
    )
    assert event_types(job_store, job_id) == ["queued"]
    assert job_store.lease_owner(job_id) == "worker-b"


@pytest.mark.parametrize(
    "state", [JobState.RUNNING, JobState.SUCCEEDED, JobState.CANCELED, JobState.EXPIRED]
)
def test_only_a_queued_job_starts(job_store: JobStore, state: JobState) -> None:
    # a running job's lease is WORKER's own here: the state alone refuses it
    job_id, _ = job_in_state(job_store, state)
    before = job_store.get(job_id), lease_token(job_store, job_id)
    events = event_types(job_store, job_id)
    with pytest.raises(IllegalTransition):
        job_store.acquire_and_start(job_id, WORKER)
    assert (job_store.get(job_id), lease_token(job_store, job_id)) == before
    assert event_types(job_store, job_id) == events


def test_running_cap_refuses_with_nothing_written(job_store: JobStore) -> None:
    first, _ = job_in_state(job_store, JobState.QUEUED, owner="key_a")
    second, _ = job_in_state(job_store, JobState.QUEUED, owner="key_a")
    job_store.acquire_and_start(first, WORKER, running_cap=1)
    with pytest.raises(QuotaExceeded):
        job_store.acquire_and_start(second, WORKER, running_cap=1)
    record = job_store.get(second)
    assert (record.state, lease_token(job_store, second), record.attempts) == (
        JobState.QUEUED,
        0,
        0,
    )
    assert job_store.lease_owner(second) is None
    _, started = job_store.acquire_and_start(second, WORKER, running_cap=2)
    assert started.state == JobState.RUNNING


def test_unknown_job(job_store: JobStore) -> None:
    with pytest.raises(JobNotFound):
        job_store.acquire_and_start("no-such-job", WORKER)
