"""Frozen records the job store hands out, and their conversion from Redis hashes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.common.accounting import ACCOUNTING_FIELD, StepAccounting
from kiln.common.ledger import LEDGER_FIELD, JobLedger
from kiln.common.request import Lane
from kiln.common.states import JobState
from kiln.storage.keys import valid_id, valid_queue

# the record's field naming its step checkpoints (storage/checkpoints.py, lua/checkpoint.lua)
CHECKPOINTS_FIELD = "checkpoints"


@dataclass(frozen=True)
class NewJob:
    """A job to create; `request` is opaque JSON to the storage layer."""

    id: str
    request: dict[str, Any]
    batch_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    owner: str | None = None
    idempotency_key: str | None = None
    fingerprint: str | None = None
    lane: str = Lane.interactive
    # the queue it waits in (`<lane>.<pipeline>`): its place in that queue's index, the per-queue
    # completion window of its runs; None: no queue index entry (positions unknown)
    queue: str | None = None
    # the job's W3C trace context (`traceparent`, `tracestate`): given at its entrance or started
    # there (kiln/common/tracing.py); {} for none
    trace: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not valid_id(self.id):
            raise ValueError(f"invalid job id {self.id!r}")
        if self.batch_id is not None and not valid_id(self.batch_id):
            raise ValueError(f"invalid batch id {self.batch_id!r}")
        if self.queue is not None and not valid_queue(self.queue):
            raise ValueError(f"invalid queue {self.queue!r}")


@dataclass(frozen=True)
class JobRecord:
    """One job as stored: state, timestamps (epoch seconds, Redis clock), results."""

    id: str
    state: JobState
    request: dict[str, Any]
    lane: str
    owner: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    progress: dict[str, Any] | None
    outputs: list[dict[str, Any]]
    error: dict[str, Any] | None
    metrics: dict[str, Any]
    batch_id: str | None
    metadata: dict[str, str]
    published: bool
    queue: str | None = None
    trace: dict[str, str] = field(default_factory=dict)  # as `NewJob.trace`
    # the steps its attempts computed, restored and recomputed (kiln/common/accounting.py)
    accounting: StepAccounting = field(default_factory=StepAccounting)
    # seconds per phase, GPU-seconds and energy over its attempts (kiln/common/ledger.py)
    ledger: JobLedger = field(default_factory=JobLedger)
    # whether it names step checkpoints an attempt recorded (storage/checkpoints.py): a job that
    # names none has none to read, so its next attempt needs no read to learn it
    checkpoints_recorded: bool = False


@dataclass(frozen=True)
class JobEvent:
    """One entry of a job's event stream; `seq` starts at 1 and has no gaps."""

    seq: int
    type: str
    time: float
    payload: dict[str, Any]


def _optional_float(value: str | None) -> float | None:
    return float(value) if value else None


def pairs_to_dict(flat: list[str]) -> dict[str, str]:
    """Turn a flat `[k1, v1, k2, v2, ...]` script reply into a dict."""
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def job_from_hash(data: dict[str, str]) -> JobRecord:
    """Build a JobRecord from the fields of a job hash (fields at their default may be absent)."""
    return JobRecord(
        id=data["id"],
        state=JobState(data["state"]),
        request=json.loads(data["request"]),
        lane=data["lane"],
        owner=data.get("owner") or None,
        created_at=float(data["created_at"]),
        started_at=_optional_float(data.get("started_at")),
        finished_at=_optional_float(data.get("finished_at")),
        attempts=int(data.get("attempts", "0")),
        progress=json.loads(data.get("progress", "null")),
        outputs=json.loads(data.get("outputs", "[]")),
        error=json.loads(data.get("error", "null")),
        metrics=json.loads(data.get("metrics", "{}")),
        batch_id=data.get("batch_id") or None,
        metadata=json.loads(data.get("metadata", "{}")),
        published=data.get("published") == "1",
        queue=data.get("queue") or None,
        trace=json.loads(data.get("trace", "{}")),
        accounting=StepAccounting.from_field(data.get(ACCOUNTING_FIELD)),
        ledger=JobLedger.from_field(data.get(LEDGER_FIELD)),
        checkpoints_recorded=bool(data.get(CHECKPOINTS_FIELD)),
    )


def event_from_entry(entry_id: str, fields: dict[str, str]) -> JobEvent:
    """Build a JobEvent from a stream entry (`<seq>-0`, fields)."""
    return JobEvent(
        seq=int(entry_id.split("-", 1)[0]),
        type=fields["type"],
        time=float(fields["time"]),
        payload=json.loads(fields["payload"]),
    )
