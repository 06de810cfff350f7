"""hold: a node leases a queued job it will start once its group can; the job stays queued.

The start (queued -> running) is the holder's alone (fenced by the token); a cancel ends the held
job at once and no start follows; a lapsed lease leaves it queued for another delivery.
"""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.storage.errors import IllegalTransition, QuotaExceeded, StaleLease
from kiln.storage.job_store import JobStore
from kiln.storage.leases import WAITING_IN_NODE, Renewal
from kiln.storage.records import JobRecord
from kiln.storage.transitions import Start
from tests.storage.helpers import WORKER, event_types, job_in_state, lease_token
from tests.tasks.node.conftest import wait_until_expired

pytestmark = pytest.mark.every_redis  # refusals are script errors: 6.2 must pass them on too

WAITING = {"stage": WAITING_IN_NODE, "node": "node-1", "position": 2}


def test_a_held_job_stays_queued_and_says_where_it_waits(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    depth = job_store.queue_depth()
    token, record = job_store.hold(job_id, WORKER, "node-1", 2)
    assert (record.state, record.attempts, record.started_at) == (JobState.QUEUED, 0, None)
    assert record.progress == WAITING
    assert (lease_token(job_store, job_id), job_store.lease_owner(job_id)) == (token, WORKER)
    assert job_store.queue_depth() == depth  # still counted as queued
    assert event_types(job_store, job_id) == ["queued", "progress"]
    assert job_store.events(job_id, count=10)[-1].payload == WAITING
    assert job_store.renew_lease(job_id, token) is Renewal.RENEWED
    assert job_id not in job_store.reap_lapsed()  # nothing running to reap


def test_the_holder_alone_starts_it_and_the_start_clears_the_wait(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    old = job_store.acquire_lease(job_id, WORKER)
    token, _ = job_store.hold(job_id, WORKER, "node-1", 0)
    with pytest.raises(StaleLease):
        job_store.start(job_id, old)
    started = job_store.start(job_id, token, node_id="node-1")
    assert (started.state, started.attempts, started.progress) == (JobState.RUNNING, 1, None)
    assert started.started_at is not None
    assert event_types(job_store, job_id) == ["queued", "progress", "running"]


def test_a_started_held_job_runs_under_its_lease_and_names_its_node(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    token, _ = job_store.hold(job_id, WORKER, "node-1", 0)
    record = job_store.start(job_id, token, node_id="node-1")
    assert (record.attempts, lease_token(job_store, job_id)) == (1, token)
    assert job_store.lease_owner(job_id) == WORKER
    assert job_store.queue_depth() == 0
    payload = job_store.events(job_id, count=10)[-1].payload
    assert (payload["node_id"], payload["owner"], payload["attempts"]) == ("node-1", WORKER, 1)
    # the lease is renewable with the token and the running set holds the job (the reaper's view)
    assert job_store.renew_lease(job_id, token) is Renewal.RENEWED
    assert job_id not in job_store.reap_lapsed()
    job_store.succeed(job_id, token, [{"key": "k"}], {"run_s": 0.1})
    assert job_store.get(job_id).state == JobState.SUCCEEDED


def test_progress_of_a_held_job_is_its_wait_only(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    token, _ = job_store.hold(job_id, WORKER, "node-1", 3)
    job_store.set_progress(job_id, token, {**WAITING, "position": 1})  # moved up
    assert job_store.get(job_id).progress == {**WAITING, "position": 1}
    with pytest.raises(IllegalTransition):
        job_store.set_progress(job_id, token, {"stage": "denoising", "step": 1, "total": 4})
    job_store.start(job_id, token)
    job_store.set_progress(job_id, token, {"stage": "denoising", "step": 1, "total": 4})
    events = event_types(job_store, job_id)
    job_store.set_progress(job_id, token, WAITING)  # late: the job started meanwhile
    assert job_store.get(job_id).progress == {"stage": "denoising", "step": 1, "total": 4}
    assert event_types(job_store, job_id) == events


def test_a_canceled_held_job_ends_at_once_and_never_starts(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    token, _ = job_store.hold(job_id, WORKER, "node-1", 0)
    assert job_store.cancel(job_id).state == JobState.CANCELED
    assert job_store.lease_owner(job_id) is None
    with pytest.raises((IllegalTransition, StaleLease)):
        job_store.start(job_id, token)
    assert job_store.renew_lease(job_id, token) is Renewal.ENDED
    assert job_store.get(job_id).state == JobState.CANCELED


def test_a_lapsed_hold_leaves_the_job_queued_for_another_delivery(job_store: JobStore) -> None:
    short = JobStore(job_store.redis, job_store.settings.model_copy(update={"lease_ttl_s": 0.05}))
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    dead, _ = short.hold(job_id, "dead-node/1", "dead-node", 0)  # ...and that node died
    wait_until_expired(job_store, job_id)
    assert job_store.reap_lapsed() == []  # queued: the reaper has nothing to move
    token, record = job_store.hold(job_id, WORKER, "node-1", 0)
    assert (record.state, record.attempts) == (JobState.QUEUED, 0)
    with pytest.raises(StaleLease):
        job_store.start(job_id, dead)  # the dead node's start, were it to come, is fenced off
    assert job_store.start(job_id, token).attempts == 1  # it runs once


def test_the_running_cap_applies_at_the_start_of_a_held_job(job_store: JobStore) -> None:
    first, _ = job_in_state(job_store, JobState.QUEUED, owner="key_a")
    second, _ = job_in_state(job_store, JobState.QUEUED, owner="key_a")
    tokens = [job_store.hold(job_id, WORKER, "node-1", 0)[0] for job_id in (first, second)]
    job_store.start(first, tokens[0], running_cap=1)
    with pytest.raises(QuotaExceeded):
        job_store.start(second, tokens[1], running_cap=1)
    record = job_store.get(second)
    assert (record.state, record.attempts, lease_token(job_store, second)) == (
        JobState.QUEUED,
        0,
        tokens[1],
    )


def test_a_released_hold_waits_in_no_node(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    token, _ = job_store.hold(job_id, WORKER, "node-1", 0)
    assert job_store.release_lease(job_id, token)
    assert not job_store.release_lease(job_id, token)  # stale now
    record = job_store.get(job_id)
    assert (record.state, record.progress, job_store.lease_owner(job_id)) == (
        JobState.QUEUED,
        None,
        None,
    )


def test_a_batch_of_held_jobs_starts_in_one_call_each_as_start_would(
    job_store: JobStore,
) -> None:
    ready, stale, canceled = (job_in_state(job_store, JobState.QUEUED)[0] for _ in range(3))
    tokens = {job_id: job_store.hold(job_id, WORKER, "node-1", 0)[0] for job_id in (ready, stale)}
    old = tokens[stale]
    tokens[stale] = job_store.hold(stale, WORKER, "node-1", 0)[0]  # a newer token fences `old`
    canceled_token, _ = job_store.hold(canceled, WORKER, "node-1", 0)
    job_store.cancel(canceled)
    results = job_store.start_many(
        [
            Start(ready, tokens[ready], "node-1"),
            Start(stale, old, "node-1"),
            Start(canceled, canceled_token, "node-1"),
        ]
    )
    first, second, third = results
    assert isinstance(first, JobRecord)
    assert (first.state, first.attempts, first.progress) == (JobState.RUNNING, 1, None)
    assert isinstance(second, StaleLease)
    assert isinstance(third, (IllegalTransition, StaleLease))
    assert job_store.get(stale).state == JobState.QUEUED  # refused: nothing written
    assert job_store.get(canceled).state == JobState.CANCELED
    assert job_store.start_many([]) == []
