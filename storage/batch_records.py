"""What a fed batch is in Redis: the record to create (`NewFedBatch`) and the one read (`FedBatch`).

A fed batch is a batch record (`keys.batch`, whose per-state counters the job scripts move) with
fields of its own: status, the feeder's cursor (`fed` items handled, `offset` of the next one in
the input object), counts of lines ended without a job, the number of result lines written, and
the links between a batch and its retries (`parent_id` on the retry, `retries` on the parent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.common.defaults import BATCH_LANE
from kiln.common.states import FINAL_BATCH_STATUSES, BatchStatus, JobState, is_final_batch
from kiln.storage.errors import BatchNotFound, StorageError
from kiln.storage.keys import valid_id

# why a batch stops before every line ran: its owner canceled it, its window ended, or its input
# could not be read (`error` says why)
STOP_REASONS = FINAL_BATCH_STATUSES - {BatchStatus.completed}


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
    priority: str = BATCH_LANE
    metadata: dict[str, str] = field(default_factory=dict)
    webhook: dict[str, Any] | None = None
    invalid_part: str | None = None  # result part of the invalid lines (skip_invalid)
    parent_id: str | None = None  # the batch this one retries
    retried: tuple[str, ...] = ()  # a retry: the statuses of the parent's lines it runs again
    idempotency_key: str | None = None  # a retry's: the same key finds the same retry
    storage_url: str | None = None  # the store its input and results are written to
    # its W3C trace context (kiln/common/tracing.py): its line jobs' traces link to it
    trace: dict[str, str] = field(default_factory=dict)

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
    parent_id: str | None = None
    retries: tuple[str, ...] = ()
    error: str | None = None  # why the batch could not go on (its input could not be read)
    input_failures: int = 0  # failed reads of its input since the last one that worked
    storage_url: str | None = None  # the store its input and results live in (None: written
    # before batches recorded it; readers use their own)
    trace: dict[str, str] = field(default_factory=dict)  # as `NewFedBatch.trace`

    @property
    def final(self) -> bool:
        """Whether the batch has ended (completed, canceled or expired)."""
        return is_final_batch(self.status)

    @property
    def paused(self) -> bool:
        """Whether feeding is paused (the window drains; nothing new is fed)."""
        return self.status == BatchStatus.paused

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
        storage_url=data.get("storage_url") or None,
        created_at=float(data["created_at"]),
        started_at=_float(data.get("started_at")),
        finished_at=_float(data.get("finished_at")),
        deadline=float(data["deadline"]),
        window_s=int(data.get("window_s", "0")),
        pipeline=data.get("pipeline") or None,
        priority=data.get("priority", BATCH_LANE),
        metadata=json.loads(data.get("metadata", "{}")),
        webhook=json.loads(webhook) if webhook else None,
        counts={state: int(data.get(f"n_{state}", "0")) for state in JobState},
        ended_unfed={r: int(data.get(f"u_{r}", "0")) for r in sorted(STOP_REASONS)},
        reported=int(data.get("reported", "0")),
        parts=parts,
        seq=int(data.get("seq", "0")),
        parent_id=data.get("parent_id") or None,
        retries=tuple(r for r in data.get("retries", "").split(",") if r),
        error=data.get("error") or None,
        input_failures=int(data.get("input_failures", "0")),
        trace=json.loads(data.get("trace") or "{}"),
    )


class BatchConflict(StorageError):
    """The batch's status does not allow the requested change (pause, resume, cancel, retry)."""

    def __init__(self, batch_id: str, status: str, action: str) -> None:
        super().__init__(f"batch {batch_id} is {status}: it cannot be {action}")
        self.batch_id = batch_id
        self.status = status
        self.action = action


class RetryRunning(StorageError):
    """A retry of the same lines of the parent has not ended; `retry_id` names it."""

    def __init__(self, parent_id: str, retry_id: str) -> None:
        super().__init__(
            f"batch {parent_id} is being retried by batch {retry_id} (the same lines); "
            "retry again once it has ended"
        )
        self.parent_id = parent_id
        self.retry_id = retry_id


class RetryKeyBound(StorageError):
    """The retry's idempotency key is bound to another retry of the parent: `retry_id`."""

    def __init__(self, parent_id: str, retry_id: str, statuses: tuple[str, ...]) -> None:
        super().__init__(
            f"this Idempotency-Key made batch {retry_id}, a retry of batch {parent_id}'s "
            f"{' and '.join(statuses)} lines"
        )
        self.parent_id = parent_id
        self.retry_id = retry_id
        self.statuses = statuses
