"""Event streams (gap-free seq, order, cap, blocking reads) and retention of finished jobs."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

from kiln.common.states import TERMINAL_STATES, JobState
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from tests.storage.fed_batches import record_fed_batch
from tests.storage.helpers import event_types, job_in_state


def test_lifecycle_events_in_order(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    for step in range(1, 4):
        job_store.set_progress(job_id, token, {"stage": "denoising", "step": step, "total": 3})
    job_store.succeed(job_id, token, [{"key": "x"}], {"run_s": 1})
    assert event_types(job_store, job_id) == [
        "queued",
        "running",
        "progress",
        "progress",
        "progress",
        "succeeded",
    ]
    events = job_store.events(job_id)
    assert [e.payload.get("step") for e in events if e.type == "progress"] == [1, 2, 3]
    assert events[-1].payload["outputs"] == [{"key": "x"}]
    assert all(a.time <= b.time for a, b in itertools.pairwise(events))
    assert job_store.get(job_id).progress == {"stage": "denoising", "step": 3, "total": 3}


def test_after_seq_and_count_page_the_stream(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    for step in range(10):
        job_store.set_progress(job_id, token, {"step": step})
    everything = job_store.events(job_id)
    assert [e.seq for e in job_store.events(job_id, after_seq=4, count=3)] == [5, 6, 7]
    assert job_store.events(job_id, after_seq=everything[-1].seq) == []
    assert job_store.events("no-such-job") == []


def test_stream_is_capped(storage_settings: StorageSettings) -> None:
    store = JobStore.from_settings(storage_settings.model_copy(update={"event_stream_maxlen": 5}))
    job_id, token = job_in_state(store, JobState.RUNNING)
    for step in range(20):
        store.set_progress(job_id, token, {"step": step})
    assert store.redis.xlen(store.keys.events(job_id)) == 5
    assert [e.seq for e in store.events(job_id)] == [18, 19, 20, 21, 22]


def test_blocking_read_wakes_on_new_event(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    last = job_store.events(job_id)[-1].seq
    ready = threading.Event()

    def writer() -> None:
        ready.wait(timeout=30)
        job_store.set_progress(job_id, token, {"step": 7})

    thread = threading.Thread(target=writer)
    thread.start()
    ready.set()
    events = job_store.events(job_id, after_seq=last, block_ms=20_000)
    thread.join(timeout=30)
    assert [(e.seq, e.payload) for e in events] == [(last + 1, {"step": 7})]


def _ttls(store: JobStore, job_id: str, idem: str) -> list[int]:
    keys = store.keys
    return [
        store.redis.ttl(keys.job(job_id)),
        store.redis.ttl(keys.events(job_id)),
        store.redis.ttl(keys.idempotency(idem)),
    ]


@pytest.mark.parametrize("final", sorted(TERMINAL_STATES))
def test_retention_only_once_terminal(job_store: JobStore, final: JobState) -> None:
    idem = f"idem-{final}"
    job_id, token = job_in_state(job_store, JobState.QUEUED, idempotency_key=idem)
    assert _ttls(job_store, job_id, idem) == [-1, -1, -1]
    if final in (JobState.SUCCEEDED, JobState.CANCELED):
        token = job_store.acquire_lease(job_id, "w")
        job_store.start(job_id, token)
        assert _ttls(job_store, job_id, idem) == [-1, -1, -1]
        job_store.record_webhook_attempt(job_id, {"status": 500})
        assert job_store.redis.ttl(job_store.keys.webhooks(job_id)) == -1
    if final == JobState.SUCCEEDED:
        job_store.succeed(job_id, token, [], {})
    elif final == JobState.CANCELED:
        job_store.cancel(job_id)
        job_store.finish_canceled(job_id, token)
    elif final == JobState.FAILED:
        job_store.fail(job_id, None, {"type": "x"})
    else:
        job_store.expire(job_id)
    retention = job_store.settings.retention_s
    assert all(0 < ttl <= retention for ttl in _ttls(job_store, job_id, idem))
    job_store.record_webhook_attempt(job_id, {"status": 200})
    assert 0 < job_store.redis.ttl(job_store.keys.webhooks(job_id)) <= retention
    assert job_store.redis.exists(job_store.keys.cancel(job_id)) == 0


def test_batch_expires_when_all_jobs_finished(job_store: JobStore) -> None:
    record_fed_batch(job_store, "b1", 2)
    first, _ = job_in_state(job_store, JobState.QUEUED, batch_id="b1")
    job_in_state(job_store, JobState.FAILED, batch_id="b1")
    assert job_store.redis.ttl(job_store.keys.batch("b1")) == -1
    job_store.expire(first)
    assert job_store.redis.ttl(job_store.keys.batch("b1")) > 0


def test_prune_indexes_after_expiry(storage_settings: StorageSettings) -> None:
    # two stores on one namespace: a job kept 10 minutes is not due, one kept 1 s soon is, so
    # neither half depends on how fast this machine gets from one line to the next
    lasting = JobStore.from_settings(storage_settings.model_copy(update={"retention_s": 600}))
    store = JobStore.from_settings(storage_settings.model_copy(update={"retention_s": 1}))
    kept, _ = job_in_state(lasting, JobState.FAILED, owner="alice")
    keys = store.keys
    indexes = [keys.all_index, keys.state_index("failed"), keys.owner_index("alice")]
    assert store.prune_indexes() == 0  # not expired yet
    assert all(store.redis.zscore(index, kept) is not None for index in indexes)
    record_fed_batch(store, "b", 1)
    job_id, _ = job_in_state(store, JobState.FAILED, owner="alice", batch_id="b")
    live, _ = job_in_state(store, JobState.QUEUED, owner="alice")
    deadline = time.monotonic() + 30
    while store.redis.exists(keys.job(job_id)) and time.monotonic() < deadline:
        time.sleep(0.05)
    while store.prune_indexes() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(store.redis.zscore(index, job_id) is None for index in indexes)
    assert store.redis.zscore(keys.batch_index("b"), job_id) is None
    assert store.redis.zscore(keys.all_index, live) is not None
    assert all(store.redis.zscore(index, kept) is not None for index in indexes)
    assert store.redis.zcard(keys.retired) == 1  # the lasting job's entry, not yet due


def test_prune_due_indexes_drains_every_due_entry_in_chunks(job_store: JobStore) -> None:
    # records already expired: only their index entries and retired entries are left
    keys, redis = job_store.keys, job_store.redis
    due = time.time() - 1
    ids = [f"gone-{n}" for n in range(2500)]
    redis.zadd(keys.all_index, {job_id: n for n, job_id in enumerate(ids)})
    redis.zadd(keys.retired, {json.dumps([job_id, "", "", "succeeded"]): due for job_id in ids})
    assert job_store.prune_indexes(limit=1000) == 1000  # one call: one chunk
    assert job_store.prune_due_indexes(limit=1000) == 1500
    assert redis.zcard(keys.all_index) == 0
    assert redis.zcard(keys.retired) == 0
    assert job_store.prune_due_indexes() == 0
