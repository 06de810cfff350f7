"""Batch records: a total and per-state counters moved by the job scripts in the same step."""

from __future__ import annotations

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import BatchNotFound
from kiln.storage.keys import valid_id
from kiln.storage.records import BatchRecord, batch_from_hash, pairs_to_dict
from kiln.storage.states import JobState


class BatchOps(StoreBase):
    """Create and read batches."""

    @redis_boundary
    def create_batch(
        self, batch_id: str, total: int, metadata: dict[str, str] | None = None
    ) -> BatchRecord:
        """Create the batch (before its jobs); if it exists already, return it unchanged."""
        if not valid_id(batch_id):
            raise ValueError(f"invalid batch id {batch_id!r}")
        if total < 0:
            raise ValueError("total must be >= 0")
        reply = self._run(
            "create_batch",
            [self.keys.batch(batch_id)],
            [total, dumps(metadata or {}), *(state.value for state in JobState)],
        )
        return batch_from_hash(batch_id, pairs_to_dict(reply))

    @redis_boundary
    def get_batch(self, batch_id: str) -> BatchRecord:
        """The batch with its per-state counts; BatchNotFound if there is none."""
        if not valid_id(batch_id):
            raise BatchNotFound(batch_id)
        data = self.redis.hgetall(self.keys.batch(batch_id))
        if not data:
            raise BatchNotFound(batch_id)
        return batch_from_hash(batch_id, data)
