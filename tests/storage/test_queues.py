"""Queue order, owner counts and caps, completion windows, pauses and drain requests."""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.errors import IllegalTransition, QuotaExceeded
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from tests.storage.helpers import WORKER, event_types, new_job

QUEUE, OTHER = "bulk.tiny", "interactive.tiny"
FLAKY = {"type": "Flaky", "message": "x", "retryable": True}


def queued(store: JobStore, owner: str | None = None, queue: str = QUEUE) -> str:
    record, created = store.create_job(new_job(owner=owner, queue=queue))
    assert created
    return record.id


def rank(store: JobStore, job_id: str, queue: str = QUEUE) -> int | None:
    return store.queue_snapshot(job_id, queue, None, []).rank


def owner_counts(store: JobStore, owner: str) -> tuple[int, int]:
    q = store.redis.hget(store.keys.owner_queued, owner)
    r = store.redis.hget(store.keys.owner_running, owner)
    return int(q or 0), int(r or 0)


def start(store: JobStore, job_id: str, running_cap: int | None = None) -> int:
    token = store.acquire_lease(job_id, WORKER)
    store.start(job_id, token, running_cap=running_cap)
    return token


def test_the_queue_index_is_queue_order_and_only_queued_jobs(job_store: JobStore) -> None:
    a, b, c = (queued(job_store) for _ in range(3))
    assert [rank(job_store, j) for j in (a, b, c)] == [0, 1, 2]
    assert job_store.get(a).queue == QUEUE
    token = start(job_store, a)
    assert [rank(job_store, j) for j in (a, b, c)] == [None, 0, 1]
    job_store.requeue(a, token, FLAKY)  # a retry waits behind what is queued now
    assert [rank(job_store, j) for j in (a, b, c)] == [2, 0, 1]
    job_store.cancel(b)
    job_store.expire(c)
    assert [rank(job_store, j) for j in (a, b, c)] == [0, None, None]
    assert job_store.queued_ids(QUEUE) == [a]
    assert job_store.queued_counts([QUEUE, OTHER]) == {QUEUE: 1, OTHER: 0}


def test_a_job_without_a_queue_is_in_no_queue_index(job_store: JobStore) -> None:
    record, _ = job_store.create_job(new_job())
    assert record.queue is None
    assert job_store.queued_counts([QUEUE]) == {QUEUE: 0}
    token = start(job_store, record.id)
    job_store.succeed(record.id, token, [], {})
    assert job_store.queue_snapshot(record.id, QUEUE, None, [QUEUE]).finished == 0


def test_bulk_creation_fills_queue_indexes_and_owner_counts(job_store: JobStore) -> None:
    news = [new_job(owner="key_a", queue=QUEUE) for _ in range(3)]
    job_store.create_jobs([*news, new_job(queue=OTHER)])
    assert job_store.queued_ids(QUEUE) == [n.id for n in news]
    assert job_store.queued_counts([OTHER]) == {OTHER: 1}
    assert owner_counts(job_store, "key_a") == (3, 0)


def test_owner_counts_follow_every_transition(job_store: JobStore) -> None:
    ids = [queued(job_store, owner="key_a") for _ in range(4)]
    assert owner_counts(job_store, "key_a") == (4, 0)
    token = start(job_store, ids[0])
    assert owner_counts(job_store, "key_a") == (3, 1)
    job_store.requeue(ids[0], token, FLAKY)
    assert owner_counts(job_store, "key_a") == (4, 0)
    token = start(job_store, ids[0])
    job_store.succeed(ids[0], token, [], {})
    job_store.cancel(ids[1])
    job_store.fail(ids[2], None, {"type": "x", "message": "x", "retryable": False})
    assert owner_counts(job_store, "key_a") == (1, 0)
    job_store.expire(ids[3])
    assert job_store.redis.hgetall(job_store.keys.owner_queued) == {}  # at 0: no field left
    assert job_store.redis.hgetall(job_store.keys.owner_running) == {}


def test_the_queued_cap_is_checked_when_the_job_is_written(job_store: JobStore) -> None:
    first, second = queued(job_store, owner="key_a"), queued(job_store, owner="key_a")
    refused = new_job(owner="key_a", queue=QUEUE)
    with pytest.raises(QuotaExceeded, match="key_a has 2 queued jobs"):
        job_store.create_job(refused, max_queued=2)
    assert not job_store.redis.exists(job_store.keys.job(refused.id))
    assert job_store.queued_ids(QUEUE) == [first, second]
    job_store.create_job(new_job(owner="key_b", queue=QUEUE), max_queued=2)  # per owner
    job_store.cancel(first)
    job_store.create_job(refused, max_queued=2)  # room again
    assert owner_counts(job_store, "key_a") == (2, 0)


def test_an_idempotent_replay_at_the_cap_returns_the_job(job_store: JobStore) -> None:
    job = new_job(owner="key_a", queue=QUEUE, idempotency_key="k1")
    record, created = job_store.create_job(job, max_queued=1)
    again, created_again = job_store.create_job(new_job(**{**job.__dict__, "id": "other"}), 1)
    assert created
    assert not created_again
    assert again.id == record.id


def test_the_running_cap_refuses_a_start_and_writes_nothing(job_store: JobStore) -> None:
    a, b = queued(job_store, owner="key_a"), queued(job_store, owner="key_a")
    start(job_store, a, running_cap=1)
    token = job_store.acquire_lease(b, WORKER)
    before = job_store.get(b)
    with pytest.raises(QuotaExceeded, match="key_a has 1 running jobs"):
        job_store.start(b, token, running_cap=1)
    assert job_store.get(b) == before
    assert event_types(job_store, b) == ["queued"]
    assert owner_counts(job_store, "key_a") == (1, 1)
    job_store.start(b, token, running_cap=2)  # a larger cap lets it through
    assert owner_counts(job_store, "key_a") == (0, 2)


def test_finished_runs_make_a_completion_rate(job_store: JobStore) -> None:
    a, b, c = (queued(job_store) for _ in range(3))
    snapshot = job_store.queue_snapshot(c, QUEUE, OTHER, [QUEUE, OTHER])
    assert snapshot.finished == 0
    assert snapshot.completion_rate() is None
    job_store.succeed(a, start(job_store, a), [], {})
    job_store.fail(b, start(job_store, b), {"type": "x", "message": "x", "retryable": False})
    snapshot = job_store.queue_snapshot(c, QUEUE, OTHER, [QUEUE, OTHER])
    assert (snapshot.rank, snapshot.finished) == (0, 2)
    started = job_store.get(a).started_at
    assert started is not None
    assert snapshot.earliest_start == pytest.approx(started, abs=0.002)
    assert snapshot.completion_rate() == 2.0  # within a second: counted over one second
    # a job canceled while queued never ran: no completion
    job_store.cancel(c)
    assert job_store.queue_snapshot(c, QUEUE, None, [QUEUE]).finished == 2


def test_pauses_are_flags_anyone_can_read(job_store: JobStore) -> None:
    job_id = queued(job_store)
    assert job_store.pause_queue(QUEUE, by="ops") is True
    assert job_store.pause_queue(QUEUE) is False  # already paused: the first record stays
    assert job_store.paused_queues()[QUEUE]["by"] == "ops"
    snapshot = job_store.queue_snapshot(job_id, QUEUE, OTHER, [])
    assert snapshot.paused
    assert not snapshot.other_paused
    assert job_store.node_controls("node-1") == ({QUEUE}, None)
    assert job_store.resume_queue(QUEUE) is True
    assert job_store.resume_queue(QUEUE) is False
    assert job_store.paused_queues() == {}
    with pytest.raises(ValueError, match="invalid queue"):
        job_store.pause_queue("bulk:x")


def test_drain_requests_are_per_node(job_store: JobStore) -> None:
    request = job_store.request_drain("node-1", exit=True, by="ops")
    assert request.exit
    assert request.requested_at > 0
    paused, drain = job_store.node_controls("node-1")
    assert paused == set()
    assert drain == request
    assert job_store.node_controls("node-2")[1] is None
    assert job_store.drain_requests() == {"node-1": request}
    assert job_store.withdraw_drain("node-1") is True
    assert job_store.withdraw_drain("node-1") is False


def test_cancel_queued_leaves_a_running_job_alone(job_store: JobStore) -> None:
    a, b = queued(job_store), queued(job_store)
    start(job_store, a)
    with pytest.raises(IllegalTransition):
        job_store.cancel_queued(a, "purged")
    assert not job_store.cancel_requested(a)
    record = job_store.cancel_queued(b, "purged")
    assert record.state == JobState.CANCELED
    assert job_store.events(b)[-1].payload == {"reason": "purged"}


def test_api_keys_carry_their_caps(job_store: JobStore, storage_settings: StorageSettings) -> None:
    keys = ApiKeyStore(job_store.redis, storage_settings)
    capped = keys.create("h1", "capped", max_queued=5, max_running=2)
    plain = keys.create("h2", "plain")
    assert (capped.max_queued, capped.max_running) == (5, 2)
    assert (plain.max_queued, plain.max_running) == (None, None)
    assert keys.get(capped.id) == capped
    assert keys.lookup("h1") == capped
    assert keys.get("key_unknown") is None
    with pytest.raises(ValueError, match="at least 1"):
        keys.create("h3", "zero", max_running=0)
