"""Streamed object writes and ranged reads (both stores), and the batch feeder lease in Redis."""

from __future__ import annotations

import hashlib
import os

import pytest

from kiln.storage.batch_records import BatchConflict
from kiln.storage.batch_store import BatchFeeding, BatchStore, FedWrite, NewFedBatch
from kiln.storage.errors import InvalidObjectKey
from kiln.storage.job_store import JobStore
from kiln.storage.object_streams import (
    PART_SIZE,
    batch_object_key,
    iter_lines,
    open_writer,
    read_range,
)
from kiln.storage.objects import ObjectStore, open_object_store
from kiln.storage.settings import StorageSettings
from tests.storage.helpers import feeder_of


@pytest.fixture(params=["local", "s3"])
def store(
    request: pytest.FixtureRequest, storage_settings: StorageSettings, s3_settings: StorageSettings
) -> ObjectStore:
    settings = storage_settings if request.param == "local" else s3_settings
    return open_object_store(settings)


@pytest.mark.parametrize("size", [0, 1000, PART_SIZE + 12345])
def test_a_streamed_write_reads_back_whole_and_in_ranges(store: ObjectStore, size: int) -> None:
    key = batch_object_key(store.prefix, "b1", "input.jsonl")
    data = os.urandom(size)
    writer = open_writer(store, key, "application/x-ndjson")
    for start in range(0, size, 100_000):
        writer.write(data[start : start + 100_000])
    assert store.head(key) is None  # nothing visible before the commit
    stored = writer.commit()
    assert (stored.size, stored.sha256) == (size, hashlib.sha256(data).hexdigest())
    assert store.get(key) == data
    assert read_range(store, key, 10, 20) == data[10:30]
    assert read_range(store, key, size, 10) == b""
    assert read_range(store, key, size + 100, 10) == b""


def test_an_aborted_write_leaves_nothing(store: ObjectStore) -> None:
    key = batch_object_key(store.prefix, "b2", "input.jsonl")
    writer = open_writer(store, key, "application/x-ndjson")
    writer.write(os.urandom(PART_SIZE + 10))  # a multipart upload has begun on S3
    writer.abort()
    assert store.head(key) is None


def test_lines_are_read_across_chunks(store: ObjectStore) -> None:
    key = batch_object_key(store.prefix, "b3", "results", "part.jsonl")
    lines = [f'{{"n": {n}, "pad": "{"x" * (n % 50)}"}}'.encode() for n in range(500)]
    store.put(key, b"\n".join(lines) + b"\n", "application/x-ndjson")
    assert list(iter_lines(store, key, chunk_size=97)) == lines


def test_batch_object_keys_refuse_escapes() -> None:
    assert batch_object_key("out", "b1", "results", "p.jsonl") == "out/batches/b1/results/p.jsonl"
    with pytest.raises(InvalidObjectKey):
        batch_object_key("out", "../b1", "x")
    with pytest.raises(InvalidObjectKey):
        batch_object_key("out", "b1", "..", "x")


def new_batch(batch_id: str = "batch1", items: int = 3) -> NewFedBatch:
    return NewFedBatch(
        id=batch_id,
        input_key="batches/batch1/input.jsonl",
        items=items,
        lines=items,
        invalid=0,
        window_s=3600,
        owner="key1",
    )


def test_one_feeder_at_a_time_and_a_stale_one_writes_nothing(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    feeding = BatchFeeding(job_store.redis, job_store.settings)
    recorded = batches.submit_fed_batch(new_batch())
    assert (recorded.status, recorded.fed, recorded.items) == ("running", 0, 3)
    assert batches.submit_fed_batch(new_batch()).seq == recorded.seq  # exists: unchanged
    token = feeding.take_feeder("batch1", "node-a")
    assert token == 1
    assert feeding.take_feeder("batch1", "node-a") == token  # renewal keeps the token
    assert feeding.take_feeder("batch1", "node-b") == 0
    assert feeder_of(feeding, "batch1") == "node-a"
    opened = [("batch1-x", 1)]
    assert feeding.record_fed("batch1", (token, "node-b"), 0, (1, 10), opened) is FedWrite.stale
    stale = feeding.record_fed("batch1", (token, "node-a"), 5, (1, 10), opened)  # cursor moved
    assert stale is FedWrite.stale
    assert feeding.record_fed("batch1", (token, "node-a"), 0, (1, 10), opened) is FedWrite.applied
    assert feeding.open_items("batch1") == [("batch1-x", 1)]
    job_store.redis.delete(job_store.keys.batch_feeder("batch1"))  # the lease lapses
    newer = feeding.take_feeder("batch1", "node-b")
    assert newer == token + 1
    assert not feeding.record_reported("batch1", (token, "node-a"), "part", ["batch1-x"], 60)
    assert feeding.record_reported("batch1", (newer, "node-b"), "part", ["batch1-x"], 60)
    assert feeding.open_items("batch1") == []
    assert not feeding.finish_fed("batch1", (newer, "node-b"), "completed", "summary")  # unfed
    fed = feeding.record_fed("batch1", (newer, "node-b"), 1, (3, 30), [("batch1-y", 2)])
    assert fed is FedWrite.applied
    assert batches.get_fed("batch1").status == "finalizing"
    assert feeding.record_reported("batch1", (newer, "node-b"), "part2", ["batch1-y"], 60)
    assert feeding.finish_fed("batch1", (newer, "node-b"), "completed", "summary")
    done = batches.get_fed("batch1")
    assert (done.status, done.final, done.reported) == ("completed", True, 2)
    assert batches.part_keys("batch1") == ["part", "part2", "summary"]
    assert batches.active_batch_ids() == []
    assert feeding.take_feeder("batch1", "node-a") == -1  # finished: nobody feeds it
    assert job_store.redis.ttl(job_store.keys.batch("batch1")) > 0


def test_stop_only_changes_a_live_batch_once(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    batches.submit_fed_batch(new_batch())
    stopped = batches.stop_batch("batch1", "canceled")
    assert (stopped.status, stopped.stop) == ("finalizing", "canceled")
    assert batches.stop_batch("batch1", "canceled").stop == "canceled"  # asked again: as it is
    with pytest.raises(BatchConflict, match="batch1 is canceling: it cannot be expired") as no:
        batches.stop_batch("batch1", "expired")
    assert no.value.status == "canceling"
    assert batches.get_fed("batch1").stop == "canceled"
    with pytest.raises(ValueError, match="unknown stop reason"):
        batches.stop_batch("batch1", "paused")


def test_pause_and_resume_move_only_between_running_and_paused(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    batches.submit_fed_batch(new_batch())
    assert batches.pause("batch1").status == "paused"
    assert batches.pause("batch1").paused  # asked again: as it is
    assert batches.resume("batch1").status == "running"
    assert batches.resume("batch1").status == "running"
    batches.pause("batch1")
    expired = batches.stop_batch("batch1", "expired")  # a paused batch's window still ends
    assert (expired.status, expired.stop) == ("finalizing", "expired")
    for change in (batches.pause, batches.resume):
        with pytest.raises(BatchConflict) as refused:
            change("batch1")
        assert refused.value.status == "finalizing"


def test_feeding_is_refused_once_the_batch_is_asked_to_stop(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    feeding = BatchFeeding(job_store.redis, job_store.settings)
    batches.submit_fed_batch(new_batch())
    lease = (feeding.take_feeder("batch1", "node-a"), "node-a")
    batches.stop_batch("batch1", "canceled")  # lands after the feeder read the batch
    refused = feeding.record_fed("batch1", lease, 0, (1, 10), [("batch1-x", 1)])
    assert refused is FedWrite.stopping
    assert (batches.get_fed("batch1").fed, feeding.open_items("batch1")) == (0, [])
    ended = feeding.record_fed("batch1", lease, 0, (1, 10), [("batch1-x", 1)], (0, "canceled", ""))
    assert ended is FedWrite.applied  # the wind-down's own write
    assert feeding.open_items("batch1") == [("batch1-x", 1)]


def test_a_list_cursor_is_ascii_digits_only(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    for cursor in ("²", "٣", "-1", "1.5"):  # str.isdigit() takes the first two
        with pytest.raises(ValueError, match="invalid cursor"):
            batches.list_fed(cursor=cursor)
