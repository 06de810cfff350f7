"""The view of a stored batch (`contract.batches.BatchView`): counts, times, throughput, ETA."""

from __future__ import annotations

import time

from kiln.common.request import Lane
from kiln.common.states import BatchStatus, JobState, is_final_batch
from kiln.storage.batch_records import FedBatch
from kiln.tasks.contract.batches import BatchCounts, BatchOutcome, BatchView
from kiln.tasks.contract.schemas import WebhookSpec


def batch_counts(batch: FedBatch) -> BatchCounts:
    """Lines by where they are; jobs' states come from the counters the job scripts move."""
    n = batch.counts
    return BatchCounts(
        total=batch.items + batch.invalid,
        pending=batch.unfed,
        queued=n[JobState.QUEUED],
        running=n[JobState.RUNNING],
        paused=n[JobState.PAUSED],
        succeeded=n[JobState.SUCCEEDED],
        failed=n[JobState.FAILED] + batch.ended_unfed.get("failed", 0),
        canceled=n[JobState.CANCELED] + batch.ended_unfed.get("canceled", 0),
        expired=n[JobState.EXPIRED] + batch.ended_unfed.get("expired", 0),
        invalid=batch.invalid,
    )


def outcome_of(counts: BatchCounts) -> BatchOutcome:
    """Every line succeeded, some did, or none did."""
    if counts.succeeded == counts.total:
        return "succeeded"
    return "failed" if counts.succeeded == 0 else "partial"


def batch_view(batch: FedBatch, now: float | None = None) -> BatchView:
    """The batch as the API shows it; throughput and ETA from the lines finished so far."""
    now = time.time() if now is None else now
    counts = batch_counts(batch)
    final = is_final_batch(batch.status)
    finished_jobs = (
        counts.succeeded
        + counts.failed
        + sum(batch.counts[s] for s in (JobState.CANCELED, JobState.EXPIRED))
    )
    throughput = eta = None
    if batch.started_at is not None:
        elapsed = (batch.finished_at or now) - batch.started_at
        if elapsed > 0 and finished_jobs:
            throughput = finished_jobs / elapsed
            left = counts.pending + counts.queued + counts.running
            eta = 0.0 if final else left / throughput
    return BatchView(
        id=batch.id,
        status=BatchStatus(batch.status),
        outcome=outcome_of(counts) if final else None,
        counts=counts,
        created_at=batch.created_at,
        started_at=batch.started_at,
        finished_at=batch.finished_at,
        expires_at=batch.deadline,
        completion_window_s=batch.window_s,
        cancel_requested=batch.stop == "canceled",
        error=batch.error,
        throughput_per_s=throughput,
        eta_s=eta,
        results_written=batch.reported + batch.invalid,
        pipeline=batch.pipeline,
        priority=Lane(batch.priority),
        metadata=dict(batch.metadata),
        webhook=WebhookSpec.model_validate(batch.webhook) if batch.webhook else None,
        parent_id=batch.parent_id,
        retries=list(batch.retries),
    )
