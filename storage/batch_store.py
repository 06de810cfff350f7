"""Batches fed from the object store: create, read, list and steer them; the feeder's writes.

What a fed batch is lies in `batch_records`. `BatchStore` creates, reads, lists and steers them
(cancel, expire, pause); beside the record: the index of every batch and of each owner's, the
active batches (being fed or finished) and the list of committed result parts.

`BatchFeeding` is the feeder's side: its lease, the cursor, the open set and the result parts.
One feeder at a time holds a batch's feeder lease (storage/leases.py `FeederLeaseOps`: a growing
token, like job leases). The open set holds the fed jobs whose result is not written yet: it is
bounded by the feeding window. Every write presents the lease token; a feeder that lost its lease
changes nothing.
"""

from __future__ import annotations

from enum import StrEnum

from kiln.common.states import JobState, is_final_batch
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
from kiln.storage.leases import FeederLeaseOps
from kiln.storage.records import pairs_to_dict
from kiln.storage.scripts import ScriptName

__all__ = [
    "STOP_REASONS",
    "BatchConflict",
    "BatchFeeding",
    "BatchStore",
    "FedBatch",
    "FedWrite",
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


# --- the feeder's fenced writes -------------------------------------------------------------


class FedWrite(StrEnum):
    """What became of a cursor move: applied, stale (lease or cursor moved on), or stopping."""

    applied = "applied"
    stale = "stale"
    stopping = "stopping"  # the batch was canceled or expired since the feeder read it


_FED_REPLIES = {1: FedWrite.applied, 0: FedWrite.stale, 2: FedWrite.stopping}


class BatchFeeding(FeederLeaseOps):
    """Fenced writes of the one feeder of each batch (its lease: storage/leases.py)."""

    def _feeder_keys(self, batch_id: str) -> list[str]:
        k = self.keys
        return [k.batch(batch_id), k.batch_feeder(batch_id), k.batch_open(batch_id)]

    @redis_boundary
    def open_items(self, batch_id: str) -> list[tuple[str, int]]:
        """The batch's fed jobs whose result is not written yet: (job id, line), by line."""
        pairs = self.redis.zrange(self.keys.batch_open(batch_id), 0, -1, withscores=True)
        return [(job_id, int(line)) for job_id, line in pairs]

    @redis_boundary
    def record_fed(
        self,
        batch_id: str,
        lease: tuple[int, str],
        read_at: int,
        cursor: tuple[int, int],
        opened: list[tuple[str, int]],
        ended: tuple[int, str, str] = (0, "", ""),
    ) -> FedWrite:
        """Move the cursor from `read_at` (as the feeder read it) to `cursor` (fenced).

        `cursor` = (items handled, byte offset of the next item); `opened` = (job id, line) of the
        jobs created (or found) for those lines; `ended` = (lines ended without a job, the reason,
        the object key of their result part): a write with lines ended is the wind-down's, any
        other one feeds new jobs and is refused (`stopping`) once the batch was asked to stop.
        Lines ended are counted as finished under their reason (`storage.counters`), as lines
        whose job ended are. Nothing is written unless `applied`.
        """
        token, owner = lease
        new_cursor, offset = cursor
        count, reason, part = ended
        mode = "end" if reason else "feed"
        keys = [
            *self._feeder_keys(batch_id),
            self.keys.batch_parts(batch_id),
            self.keys.finished_counts,
        ]
        flat: list[str | int] = []
        for job_id, line in opened:
            flat += [line, job_id]
        args = [token, owner, read_at, new_cursor, offset, count, reason, part, mode, *flat]
        return _FED_REPLIES[int(self._run("batch_fed", keys, args))]

    @redis_boundary
    def record_reported(
        self,
        batch_id: str,
        lease: tuple[int, str],
        part: str,
        job_ids: list[str],
        retention_s: int,
    ) -> bool:
        """The results of `job_ids` are stored in the object `part` (fenced); False if stale.

        Their job records then expire after `retention_s`: the results are their durable record.
        """
        token, owner = lease
        k = self.keys
        job_keys = [key for j in job_ids for key in (k.job(j), k.events(j), k.webhooks(j))]
        keys = [*self._feeder_keys(batch_id), k.batch_parts(batch_id), k.retired, *job_keys]
        args = [token, owner, part, max(0, retention_s), *job_ids]
        return bool(self._run("batch_reported", keys, args))

    @redis_boundary
    def finish_fed(
        self, batch_id: str, lease: tuple[int, str], status: str, summary_part: str
    ) -> bool:
        """End the batch with `status` and its summary part (fenced); False if not applicable."""
        if not is_final_batch(status):
            raise ValueError(f"not a final status: {status!r}")
        token, owner = lease
        keys = [
            *self._feeder_keys(batch_id),
            self.keys.batch_parts(batch_id),
            self.keys.active_batches,
            self.keys.finished_counts,
        ]
        args = [token, owner, batch_id, status, summary_part, self.settings.retention_s]
        return bool(self._run("batch_finish", keys, args))

    @redis_boundary
    def input_failed(self, batch_id: str, now: float) -> tuple[int, float]:
        """Count a failed read of the batch's input: (failures in a row, when the first was)."""
        key = self.keys.batch(batch_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, "input_failed_at", repr(now))
        pipe.hincrby(key, "input_failures", 1)
        pipe.hget(key, "input_failed_at")
        _, failures, since = pipe.execute()
        return int(failures), float(since)

    @redis_boundary
    def input_read(self, batch_id: str) -> None:
        """The batch's input was read again: its failures in a row start over."""
        self.redis.hdel(self.keys.batch(batch_id), "input_failures", "input_failed_at")

    @redis_boundary
    def owner_queued(self, owner: str) -> int:
        """How many queued jobs the owner has now, as the state machine counts them."""
        return int(self.redis.hget(self.keys.owner_queued, owner) or 0)

    @redis_boundary
    def job_states(self, job_ids: list[str]) -> list[str | None]:
        """The state of each job (None where there is no record), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id if valid_id(job_id) else "-"), "state")
        return list(pipe.execute())
