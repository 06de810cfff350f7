"""Batches fed from the object store: their records, the feeder lease, the cursor and result parts.

A fed batch is a batch record (`keys.batch`, whose per-state counters the job scripts move) with
fields of its own: status, the feeder's cursor (`fed` items handled, `offset` of the next one in
the input object), counts of lines ended without a job, and the number of result lines written.
Beside it: the feeder lease (one feeder at a time, fenced by a growing token, like job leases),
the open set (fed jobs whose result is not written yet: bounded by the feeding window) and the
list of committed result parts (object keys). Every write of a feeder presents its lease token;
a feeder that lost its lease changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import BatchNotFound
from kiln.storage.keys import valid_id
from kiln.storage.records import pairs_to_dict
from kiln.storage.states import JobState

FINAL_STATUSES = frozenset({"completed", "canceled", "expired"})
STOP_REASONS = frozenset({"canceled", "expired"})
# the active batches one feeder pass looks at
_ACTIVE_LIMIT = 10_000
# list_fed reads this many index pages before it hands a cursor back with a short page
_MAX_SCAN_ROUNDS = 8


@dataclass(frozen=True)
class NewFedBatch:
    """A validated batch to record: its input object and what applies to all of its lines."""

    id: str
    input_key: str
    items: int  # valid lines: one job each
    lines: int  # non-blank input lines, invalid ones included
    invalid: int
    window_s: int
    owner: str | None = None
    pipeline: str | None = None
    priority: str = "bulk"
    metadata: dict[str, str] = field(default_factory=dict)
    webhook: dict[str, Any] | None = None
    invalid_part: str | None = None  # result part of the invalid lines (skip_invalid)

    def __post_init__(self) -> None:
        if not valid_id(self.id):
            raise ValueError(f"invalid batch id {self.id!r}")


@dataclass(frozen=True)
class FedBatch:
    """A fed batch as stored; `counts` are its jobs per state (lines ended unfed not included)."""

    id: str
    owner: str | None
    status: str
    stop: str | None
    lines: int
    items: int
    invalid: int
    fed: int
    offset: int
    input_key: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    deadline: float
    window_s: int
    pipeline: str | None
    priority: str
    metadata: dict[str, str]
    webhook: dict[str, Any] | None
    counts: dict[JobState, int]
    ended_unfed: dict[str, int]
    reported: int
    parts: int
    seq: int

    @property
    def final(self) -> bool:
        """Whether the batch has ended (completed, canceled or expired)."""
        return self.status in FINAL_STATUSES

    @property
    def unfed(self) -> int:
        """Items the feeder has not reached yet."""
        return max(0, self.items - self.fed)


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def fed_batch_from_hash(batch_id: str, data: dict[str, str], parts: int) -> FedBatch:
    """Build a FedBatch from the fields of its record; BatchNotFound if it is no fed batch."""
    if "status" not in data or "input_key" not in data:
        raise BatchNotFound(batch_id)
    webhook = data.get("webhook") or ""
    return FedBatch(
        id=batch_id,
        owner=data.get("owner") or None,
        status=data["status"],
        stop=data.get("stop") or None,
        lines=int(data.get("lines", "0")),
        items=int(data.get("items", "0")),
        invalid=int(data.get("invalid", "0")),
        fed=int(data.get("fed", "0")),
        offset=int(data.get("offset", "0")),
        input_key=data["input_key"],
        created_at=float(data["created_at"]),
        started_at=_float(data.get("started_at")),
        finished_at=_float(data.get("finished_at")),
        deadline=float(data["deadline"]),
        window_s=int(data.get("window_s", "0")),
        pipeline=data.get("pipeline") or None,
        priority=data.get("priority", "bulk"),
        metadata=json.loads(data.get("metadata", "{}")),
        webhook=json.loads(webhook) if webhook else None,
        counts={state: int(data.get(f"n_{state}", "0")) for state in JobState},
        ended_unfed={r: int(data.get(f"u_{r}", "0")) for r in sorted(STOP_REASONS)},
        reported=int(data.get("reported", "0")),
        parts=parts,
        seq=int(data.get("seq", "0")),
    )


class BatchStore(StoreBase):
    """Records, leases, cursors and result parts of fed batches."""

    def _feeder_keys(self, batch_id: str) -> list[str]:
        k = self.keys
        return [k.batch(batch_id), k.batch_feeder(batch_id), k.batch_open(batch_id)]

    @redis_boundary
    def submit_fed_batch(self, new: NewFedBatch) -> FedBatch:
        """Record the batch (running, cursor at its first item) unless it exists; returns it."""
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
        }
        keys = [
            k.batch(new.id),
            k.active_batches,
            k.batch_list,
            k.batch_owner_list(new.owner) if new.owner else "",
            k.batch_seq,
            k.batch_parts(new.id),
        ]
        args = [new.id, dumps(fields), new.window_s, new.invalid_part or ""]
        reply = self._run("batch_submit", keys, [*args, *(state.value for state in JobState)])
        parts = int(self.redis.llen(k.batch_parts(new.id)))
        return fed_batch_from_hash(new.id, pairs_to_dict(reply), parts)

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
        if cursor is not None and not cursor.isdigit():
            raise ValueError(f"invalid cursor {cursor!r}")
        upper = "+inf" if cursor is None else f"({cursor}"
        found: list[FedBatch] = []
        for _ in range(_MAX_SCAN_ROUNDS):
            page = self.redis.zrevrangebyscore(index, upper, "-inf", 0, limit, withscores=True)
            batches = self.get_fed_many([member for member, _ in page])
            gone = [m for (m, _), b in zip(page, batches, strict=True) if b is None]
            if gone:
                self.redis.zrem(index, *gone)
            for (_, score), batch in zip(page, batches, strict=True):
                if batch is not None:
                    found.append(batch)
                    if len(found) == limit:
                        return found, str(int(score))
            if len(page) < limit:
                return found, None
            upper = f"({int(page[-1][1])}"
        return found, upper[1:]

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
    def take_feeder(self, batch_id: str, owner: str) -> int:
        """Take or keep the batch's feeder lease: its token; 0 if held elsewhere, -1 if ended."""
        ttl_ms = max(1, int(self.settings.lease_ttl_s * 1000))
        keys = [self.keys.batch(batch_id), self.keys.batch_feeder(batch_id)]
        return int(self._run("batch_lease", keys, [owner, ttl_ms]))

    @redis_boundary
    def feeder_of(self, batch_id: str) -> str | None:
        """Owner of the batch's live feeder lease, or None."""
        held: str | None = self.redis.get(self.keys.batch_feeder(batch_id))
        return held.split("|", 1)[1] if held else None

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
    ) -> bool:
        """Move the cursor from `read_at` (as the feeder read it) to `cursor` (fenced).

        `cursor` = (items handled, byte offset of the next item); `opened` = (job id, line) of the
        jobs created (or found) for those lines; `ended` = (lines ended without a job, the reason,
        the object key of their result part). False when the lease or the cursor moved on:
        nothing is written then.
        """
        token, owner = lease
        new_cursor, offset = cursor
        count, reason, part = ended
        keys = [*self._feeder_keys(batch_id), self.keys.batch_parts(batch_id)]
        flat: list[str | int] = []
        for job_id, line in opened:
            flat += [line, job_id]
        args = [token, owner, read_at, new_cursor, offset, count, reason, part, *flat]
        return bool(self._run("batch_fed", keys, args))

    @redis_boundary
    def record_reported(
        self, batch_id: str, lease: tuple[int, str], part: str, job_ids: list[str]
    ) -> bool:
        """The results of `job_ids` are stored in the object `part` (fenced); False if stale."""
        token, owner = lease
        keys = [*self._feeder_keys(batch_id), self.keys.batch_parts(batch_id)]
        return bool(self._run("batch_reported", keys, [token, owner, part, *job_ids]))

    @redis_boundary
    def stop_batch(self, batch_id: str, reason: str) -> FedBatch:
        """Ask the batch to stop feeding (canceled or expired); returns it after. Unfenced."""
        if reason not in STOP_REASONS:
            raise ValueError(f"unknown stop reason {reason!r}")
        if not valid_id(batch_id):
            raise BatchNotFound(batch_id)
        reply = self._run("batch_stop", [self.keys.batch(batch_id)], [reason])
        if not reply:
            raise BatchNotFound(batch_id)
        parts = int(self.redis.llen(self.keys.batch_parts(batch_id)))
        return fed_batch_from_hash(batch_id, pairs_to_dict(reply), parts)

    @redis_boundary
    def finish_fed(
        self, batch_id: str, lease: tuple[int, str], status: str, summary_part: str
    ) -> bool:
        """End the batch with `status` and its summary part (fenced); False if not applicable."""
        if status not in FINAL_STATUSES:
            raise ValueError(f"not a final status: {status!r}")
        token, owner = lease
        keys = [
            *self._feeder_keys(batch_id),
            self.keys.batch_parts(batch_id),
            self.keys.active_batches,
        ]
        args = [token, owner, batch_id, status, summary_part, self.settings.retention_s]
        return bool(self._run("batch_finish", keys, args))

    @redis_boundary
    def part_keys(self, batch_id: str) -> list[str]:
        """Object keys of the batch's committed result parts, in order."""
        if not valid_id(batch_id):
            raise BatchNotFound(batch_id)
        parts: list[str] = self.redis.lrange(self.keys.batch_parts(batch_id), 0, -1)
        return parts

    @redis_boundary
    def job_states(self, job_ids: list[str]) -> list[str | None]:
        """The state of each job (None where there is no record), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id if valid_id(job_id) else "-"), "state")
        return list(pipe.execute())

    @redis_boundary
    def published_flags(self, job_ids: list[str]) -> list[tuple[str | None, bool]]:
        """(state, published) of each job (state None where there is no record)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hmget(self.keys.job(job_id if valid_id(job_id) else "-"), "state", "published")
        return [(state, published == "1") for state, published in pipe.execute()]
