"""Every batch line is counted as finished once, however it ends, job or no job.

A line whose job ends is counted by the job's terminal transition; a line that never becomes a
job is counted by the step that ends it: the feeder's write ending lines a stop reached before
they were fed (canceled, expired, failed) and the batch's creation for lines refused at submit
(invalid). A write repeated or refused (a stale cursor or lease) counts nothing.
"""

from __future__ import annotations

from kiln.storage.batch_store import BatchFeeding, BatchStore, FedWrite, NewFedBatch
from kiln.storage.counters import INVALID_LINES, LINE_STATUSES, finished_counts
from kiln.storage.job_store import JobStore, NewJob
from kiln.tasks.contract.batches import INVALID


def new_batch(batch_id: str, items: int, invalid: int = 0) -> NewFedBatch:
    return NewFedBatch(
        id=batch_id,
        input_key=f"batches/{batch_id}/input.jsonl",
        items=items,
        lines=items + invalid,
        invalid=invalid,
        window_s=3600,
        invalid_part=f"batches/{batch_id}/results/invalid.jsonl" if invalid else None,
    )


def lines(store: JobStore) -> dict[str, int]:
    return {status: finished_counts(store).lines.get(status, 0) for status in LINE_STATUSES}


def test_lines_refused_at_submit_are_counted_when_the_batch_is_created(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    batches.submit_fed_batch(new_batch("b-invalid", items=3, invalid=2))
    batches.submit_fed_batch(new_batch("b-invalid", items=3, invalid=2))  # exists: nothing new
    batches.submit_fed_batch(new_batch("b-clean", items=3))
    assert lines(job_store)[INVALID_LINES] == 2
    assert INVALID_LINES == INVALID  # the result lines' status


def test_lines_ended_before_they_became_jobs_are_counted_by_reason(job_store: JobStore) -> None:
    batches = BatchStore(job_store.redis, job_store.settings)
    feeding = BatchFeeding(job_store.redis, job_store.settings)
    batches.submit_fed_batch(new_batch("b-stopped", items=5))
    lease = (feeding.take_feeder("b-stopped", "node-a"), "node-a")
    job_store.create_job(NewJob(id="b-stopped-1", request={}, batch_id="b-stopped"))
    fed = feeding.record_fed("b-stopped", lease, 0, (1, 10), [("b-stopped-1", 1)])
    assert fed is FedWrite.applied
    batches.stop_batch("b-stopped", "canceled")
    job_store.cancel("b-stopped-1")  # the fed line: counted by its job
    ending = (3, "canceled", "batches/b-stopped/results/unfed-1.jsonl")
    assert feeding.record_fed("b-stopped", lease, 1, (4, 40), [], ending) is FedWrite.applied
    # the same write again (a retry after a lost reply): the cursor moved on, nothing counted
    assert feeding.record_fed("b-stopped", lease, 1, (4, 40), [], ending) is FedWrite.stale
    assert feeding.record_fed("b-stopped", lease, 4, (5, 50), [], (1, "canceled", "")) is (
        FedWrite.applied
    )
    assert lines(job_store) == {**dict.fromkeys(LINE_STATUSES, 0), "canceled": 5}

    batches.submit_fed_batch(new_batch("b-unreadable", items=4))
    lease = (feeding.take_feeder("b-unreadable", "node-a"), "node-a")
    batches.stop_batch("b-unreadable", "failed", "the input cannot be read")
    assert feeding.record_fed("b-unreadable", lease, 0, (4, 0), [], (4, "failed", "")) is (
        FedWrite.applied
    )
    assert lines(job_store) == {**dict.fromkeys(LINE_STATUSES, 0), "canceled": 5, "failed": 4}
