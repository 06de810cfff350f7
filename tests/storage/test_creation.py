"""Creation (single, idempotent, bulk), listing with cursors, and the small bookkeeping parts."""

from __future__ import annotations

import time

import pytest

from kiln.common.states import JobState
from kiln.storage.errors import BatchNotFound, IdempotencyConflict, JobNotFound
from kiln.storage.job_store import JobStore, NewJob
from tests.storage.fed_batches import record_fed_batch
from tests.storage.helpers import job_in_state, new_job


def test_create_writes_a_queued_record(job_store: JobStore) -> None:
    new = new_job(owner="alice", metadata={"team": "a"}, lane="bulk")
    record, created = job_store.create_job(new)
    assert created
    assert (record.id, record.state, record.request) == (new.id, JobState.QUEUED, new.request)
    assert (record.owner, record.metadata, record.lane) == ("alice", {"team": "a"}, "bulk")
    assert record.attempts == 0
    assert record.started_at is None
    assert record.outputs == []
    assert job_store.get(new.id) == record
    assert job_store.queue_depth() == 1
    again, created = job_store.create_job(new)
    assert not created
    assert again == record
    assert job_store.queue_depth() == 1


def test_idempotency_same_body_same_job(job_store: JobStore) -> None:
    first, created = job_store.create_job(new_job(idempotency_key="k1"))
    second, created_again = job_store.create_job(new_job(idempotency_key="k1"))
    assert created
    assert not created_again
    assert second.id == first.id
    with pytest.raises(IdempotencyConflict):
        job_store.create_job(new_job(idempotency_key="k1", request={"prompt": "a dog"}))
    with pytest.raises(IdempotencyConflict):
        job_store.create_job(new_job(idempotency_key="k1", fingerprint="other"))
    assert job_store.queue_depth() == 1


def test_unknown_or_impossible_ids(job_store: JobStore) -> None:
    with pytest.raises(JobNotFound):
        job_store.get("missing")
    with pytest.raises(JobNotFound):
        job_store.get("../etc:passwd")
    with pytest.raises(JobNotFound):
        job_store.start("missing", 1)
    with pytest.raises(ValueError, match="invalid job id"):
        NewJob(id="a:b", request={})
    with pytest.raises(BatchNotFound):
        job_store.create_job(new_job(batch_id="nobatch"))


def test_bulk_create_in_chunks(job_store: JobStore) -> None:
    batches = record_fed_batch(job_store, "bulk1", 250, {"file": "prompts.jsonl"})
    news = [new_job(id=f"bulk1-{i}", batch_id="bulk1", lane="bulk") for i in range(250)]
    job_store.create_jobs(news, chunk_size=64)
    job_store.create_jobs(news[:100], chunk_size=64)  # a re-run creates nothing twice
    assert job_store.queue_depth() == 250
    batch = batches.get_fed("bulk1")
    assert batch.counts[JobState.QUEUED] == 250
    assert batch.metadata == {"file": "prompts.jsonl"}
    records = job_store.get_many([n.id for n in news] + ["missing"])
    assert [r.id for r in records if r] == [n.id for n in news]
    assert records[-1] is None


def test_bulk_conflicts_reported_after_the_rest(job_store: JobStore) -> None:
    job_store.create_job(new_job(idempotency_key="taken"))
    news = [new_job(), new_job(idempotency_key="taken", request={"other": 1}), new_job()]
    with pytest.raises(IdempotencyConflict, match="taken"):
        job_store.create_jobs(news)
    assert job_store.get(news[0].id)
    assert job_store.get(news[2].id)
    with pytest.raises(JobNotFound):
        job_store.get(news[1].id)


def test_bulk_unknown_batch(job_store: JobStore) -> None:
    with pytest.raises(BatchNotFound):
        job_store.create_jobs([new_job(batch_id="nobatch")])


def test_list_jobs_pages_newest_first(job_store: JobStore) -> None:
    ids = [job_store.create_job(new_job(owner="alice"))[0].id for _ in range(25)]
    seen, cursor, pages = [], None, 0
    while True:
        page, cursor = job_store.list_jobs(owner="alice", cursor=cursor, limit=10)
        seen += [r.id for r in page]
        pages += 1
        if cursor is None:
            break
    assert seen == ids[::-1]
    assert pages <= 4


def test_list_jobs_filters_combine(job_store: JobStore) -> None:
    record_fed_batch(job_store, "b", 3)
    a_running, _ = job_in_state(job_store, JobState.RUNNING, owner="a", batch_id="b")
    a_queued, _ = job_in_state(job_store, JobState.QUEUED, owner="a", batch_id="b")
    b_running, _ = job_in_state(job_store, JobState.RUNNING, owner="b", batch_id="b")

    def listed(**filters: object) -> list[str]:
        return [r.id for r in job_store.list_jobs(**filters)[0]]  # type: ignore[arg-type]

    assert listed(owner="a", state=JobState.RUNNING) == [a_running]
    assert listed(state=JobState.RUNNING) == [b_running, a_running]
    assert listed(batch_id="b", owner="a") == [a_queued, a_running]
    assert listed() == [b_running, a_queued, a_running]
    assert listed(owner="nobody") == []


def test_list_jobs_skips_expired_records(job_store: JobStore) -> None:
    ids = [job_store.create_job(new_job())[0].id for _ in range(5)]
    job_store.redis.delete(job_store.keys.job(ids[2]))  # as retention would
    page, cursor = job_store.list_jobs(limit=10)
    assert [r.id for r in page] == [ids[4], ids[3], ids[1], ids[0]]
    assert cursor is None
    assert job_store.redis.zscore(job_store.keys.all_index, ids[2]) is None


def test_unpublished_until_marked(job_store: JobStore) -> None:
    first, _ = job_in_state(job_store, JobState.QUEUED)
    second, _ = job_in_state(job_store, JobState.QUEUED)
    assert job_store.unpublished_jobs(3600) == []
    assert set(job_store.unpublished_jobs(0)) == {first, second}
    job_store.mark_published(first)
    assert job_store.get(first).published
    assert job_store.unpublished_jobs(0) == [second]
    job_store.cancel(second)
    assert job_store.unpublished_jobs(0) == []


def test_nodes_heartbeat(job_store: JobStore) -> None:
    job_store.publish_node("node-1", {"pipelines": ["tiny"]}, ttl_s=30)
    job_store.publish_node("node-2", {"pipelines": []}, ttl_s=0.05)
    deadline = time.monotonic() + 30
    while len(job_store.live_nodes()) > 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    (node,) = job_store.live_nodes()
    assert 0 < node.pop("heartbeat_at") <= time.time()  # when it was written
    assert node == {"pipelines": ["tiny"], "node_id": "node-1"}


def test_webhook_attempts_log(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.SUCCEEDED)
    for status in (500, 200):
        job_store.record_webhook_attempt(job_id, {"event": "completed", "status": status})
    assert [a["status"] for a in job_store.webhook_attempts(job_id)] == [500, 200]
    with pytest.raises(JobNotFound):
        job_store.record_webhook_attempt("missing", {})
