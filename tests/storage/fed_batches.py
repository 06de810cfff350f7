"""A fed batch recorded as intake records one, for storage tests whose jobs belong to a batch."""

from __future__ import annotations

from kiln.storage.batch_store import BatchStore, NewFedBatch
from kiln.storage.job_store import JobStore


def record_fed_batch(
    store: JobStore, batch_id: str, items: int, metadata: dict[str, str] | None = None
) -> BatchStore:
    """Record a running batch of `items` valid lines (jobs may then name it); returns its store."""
    batches = BatchStore(store.redis, store.settings)
    new = NewFedBatch(
        id=batch_id,
        input_key=f"batches/{batch_id}/input.jsonl",
        items=items,
        lines=items,
        invalid=0,
        window_s=3600,
        metadata=metadata or {},
    )
    batches.submit_fed_batch(new)
    return batches
