"""Batches fed from the object store: create, read, list and steer them (cancel, expire, pause).

What a fed batch is lies in `batch_records`; the feeder's own fenced writes (its lease, cursor,
open set and result parts) in `batch_feeding`. Beside the record: the index of every batch and of
each owner's, the active batches (being fed or finished) and the list of committed result parts.
"""

from __future__ import annotations

from kiln.common.states import JobState
from kiln.storage.base import StoreBase, dumps
from kiln.storage.batch_records import (
    STOP_REASONS,
    BatchConflict,
    FedBatch,
    NewFedBatch,
    RetryKeyBound,
    RetryRunning,
    fed_batch_from_hash,
)
from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import BatchNotFound
from kiln.storage.index_pages import newest_first
from kiln.storage.keys import valid_id
from kiln.storage.records import pairs_to_dict
from kiln.storage.scripts import ScriptName

__all__ = [
    "STOP_REASONS",
    "BatchConflict",
    "BatchStore",
    "FedBatch",
    "NewFedBatch",
    "RetryKeyBound",
    "RetryRunning",
]
# the active batches one feeder pass looks at
_ACTIVE_LIMIT = 10_000
# what the control scripts are asked to do, as the conflict names it
_ACTIONS = {
    "canceled": "canceled",
    "expired": "expired",
    "failed": "failed",
    "pause": "paused",
    "resume": "resumed",
}


class BatchStore(StoreBase):
    """Records, indexes and status changes of fed batches."""

    @redis_boundary
    def submit_fed_batch(self, new: NewFedBatch) -> FedBatch:
        """Record the batch (running, cursor at its first item) unless it exists; returns it.

        A retry (`new.parent_id`) is listed among its parent's `retries` in the same step; see
        `submit_retry` for what may refuse it.
        """
        return self.submit_retry(new)[0]

    @redis_boundary
    def submit_retry(self, new: NewFedBatch) -> tuple[FedBatch, bool]:
        """Record a retry of the parent's lines `new.retried`: (the batch, whether it is new).

        RetryRunning (nothing written) while a retry of one of those statuses has not ended; a
        bound `new.idempotency_key` answers the retry it made (created False), or RetryKeyBound
        if that retry was of other statuses.
        """
        found = self._submit(new, check_only=False)
        assert found is not None  # only a check answers nothing
        return found

    @redis_boundary
    def check_retry(self, new: NewFedBatch) -> FedBatch | None:
        """What `submit_retry` would answer without recording anything: None if it would create.

        Raises as `submit_retry`; the batch its idempotency key made when bound.
        """
        found = self._submit(new, check_only=True)
        return found[0] if found is not None else None

    def _submit(self, new: NewFedBatch, *, check_only: bool) -> tuple[FedBatch, bool] | None:
        k = self.keys
        fields = {
            "owner": new.owner or "",
            "input_key": new.input_key,
            "items": str(new.items),
            "total": str(new.items),
            "lines": str(new.lines),
            "invalid": str(new.invalid),
            "pipeline": new.pipeline or "",
            "priority": new.priority,
            "metadata": dumps(new.metadata),
            "webhook": dumps(new.webhook) if new.webhook else "",
            "parent_id": new.parent_id or "",
            "storage_url": new.storage_url or "",
        }
        if new.trace:
            fields["trace"] = dumps(new.trace)
        keys = [
            k.batch(new.id),
            k.active_batches,
            k.batch_list,
            k.batch_owner_list(new.owner) if new.owner else "",
            k.batch_seq,
            k.batch_parts(new.id),
            k.batch(new.parent_id) if new.parent_id and valid_id(new.parent_id) else "",
            k.finished_counts,
        ]
        retried = " ".join(sorted(new.retried))
        args = [
            new.id,
            dumps(fields),
            new.window_s,
            new.invalid_part or "",
            retried,
            new.idempotency_key or "",
            k.batch_prefix,
            "1" if check_only else "",
        ]
        outcome, *reply = self._run("batch_submit", keys, [*args, *(s.value for s in JobState)])
        parent = new.parent_id or ""
        if outcome == "retrying":
            raise RetryRunning(parent, str(reply[0]))
        if outcome == "bound":
            retry_id, statuses = str(reply[0]), str(reply[1])
            if statuses != retried:
                raise RetryKeyBound(parent, retry_id, tuple(statuses.split()))
            return self.get_fed(retry_id), False
        if outcome == "free":
            return None
        parts = int(self.redis.llen(k.batch_parts(new.id)))
        return fed_batch_from_hash(new.id, pairs_to_dict(reply[0]), parts), True

    @redis_boundary
    def get_fed(self, batch_id: str) -> FedBatch:
        """The batch; BatchNotFound if there is none (never created, expired, or not fed)."""
        found = self.get_fed_many([batch_id])[0]
        if found is None:
            raise BatchNotFound(batch_id)
        return found

    @redis_boundary
    def get_fed_many(self, batch_ids: list[str]) -> list[FedBatch | None]:
        """The batches in order (None where missing), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in batch_ids:
            safe = batch_id if valid_id(batch_id) else "-"
            pipe.hgetall(self.keys.batch(safe))
            pipe.llen(self.keys.batch_parts(safe))
        replies = pipe.execute()
        found: list[FedBatch | None] = []
        for index, batch_id in enumerate(batch_ids):
            data, parts = replies[2 * index], replies[2 * index + 1]
            try:
                found.append(fed_batch_from_hash(batch_id, data, int(parts)) if data else None)
            except BatchNotFound:
                found.append(None)
        return found

    @redis_boundary
    def list_fed(
        self, owner: str | None = None, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[FedBatch], str | None]:
        """Batches newest first (an owner's, or all); pass the returned cursor for more.

        A page may be shorter than `limit` while a cursor is still returned; None means there is
        nothing more. Expired batches are skipped and dropped from the index read.
        """
        index = self.keys.batch_owner_list(owner) if owner is not None else self.keys.batch_list
        return newest_first(self.redis, index, cursor, limit, self.get_fed_many)

    @redis_boundary
    def active_batch_ids(self) -> list[str]:
        """Ids of the batches still being fed or finished, oldest first."""
        ids: list[str] = self.redis.zrange(self.keys.active_batches, 0, _ACTIVE_LIMIT - 1)
        return ids

    @redis_boundary
    def drop_active(self, batch_id: str) -> None:
        """Forget a batch in the active set whose record is gone (expired or never completed)."""
        self.redis.zrem(self.keys.active_batches, batch_id)

    @redis_boundary
    def stop_batch(self, batch_id: str, reason: str, error: str | None = None) -> FedBatch:
        """Ask the batch to stop feeding (canceled, expired or failed); returns it after. Unfenced.

        Asking again for the same stop returns the batch as it is; a cancel overrides a failure;
        BatchConflict for a finished batch or one already stopping for another reason. `error`
        (why it cannot go on) is kept on a live batch in any case.
        """
        if reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {reason!r}")
        return self._control(batch_id, "batch_stop", reason, error or "")

    @redis_boundary
    def pause(self, batch_id: str) -> FedBatch:
        """Pause feeding a running batch (idempotent); BatchConflict in any other status."""
        return self._control(batch_id, "batch_pause", "pause")

    @redis_boundary
    def resume(self, batch_id: str) -> FedBatch:
        """Resume feeding a paused batch (idempotent); BatchConflict in any other status."""
        return self._control(batch_id, "batch_pause", "resume")

    def _control(self, batch_id: str, script: ScriptName, action: str, *more: str) -> FedBatch:
        if not valid_id(batch_id):
            raise BatchNotFound(batch_id)
        reply = self._run(script, [self.keys.batch(batch_id)], [action, *more])
        if not reply:
            raise BatchNotFound(batch_id)
        outcome, pairs = reply
        parts = int(self.redis.llen(self.keys.batch_parts(batch_id)))
        batch = fed_batch_from_hash(batch_id, pairs_to_dict(pairs), parts)
        if outcome != "ok":
            raise BatchConflict(batch_id, str(outcome), _ACTIONS[action])
        return batch

    @redis_boundary
    def part_keys(self, batch_id: str) -> list[str]:
        """Object keys of the batch's committed result parts, in order."""
        if not valid_id(batch_id):
            raise BatchNotFound(batch_id)
        parts: list[str] = self.redis.lrange(self.keys.batch_parts(batch_id), 0, -1)
        return parts
