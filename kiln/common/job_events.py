"""The payloads of the events storage writes: a job's state changes and a held job's progress.

They live here, below every package, because their writer (storage/transitions.py and its Lua
scripts) may not import the contract; tasks/contract/events.py puts them in its one typed union
beside the kinds a node writes (progress, preview, output), and readers parse every entry with
that union. The Lua scripts spell four reasons themselves (`created`, `requested`,
`cancel_requested`, `lease_expired`, and a pause's `requested`, `pause_requested`, `resumed`,
`paused_retention`): the union's Literals below are what they may write, and the
round-trip test reads every kind back as its real writer stored it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from kiln.common.accounting import StepAccounting
from kiln.common.ledger import JobLedger
from kiln.common.states import JobState


class Payload(BaseModel):
    """The payload of one kind of event; `kind` is the event `type` it travels as.

    Fields it does not name are kept (`extra="allow"`): an entry a newer writer stored passes
    through an older reader unchanged.
    """

    model_config = ConfigDict(extra="allow", frozen=True)
    kind: ClassVar[str]

    def wire(self) -> dict[str, Any]:
        """The payload as the stream stores it: the fields given, nothing filled in."""
        return self.model_dump(mode="json", exclude_unset=True)


class Accounted(Payload):
    """A state change that may close an attempt or end the job: `accounting` and `ledger`.

    The job's step accounting and ledger so far, added to the event by the transition that
    closes an attempt or ends a job that ran (storage/lua/_machine.lua `with_accounting`);
    absent: zeros.
    """

    accounting: StepAccounting | None = None
    ledger: JobLedger | None = None


class ErrorData(BaseModel):
    """Why an attempt or a job failed: `{type, message, retryable}` (the view's `error`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str
    message: str = ""  # every error Kiln writes has one; a bare `{type}` still reads back
    retryable: bool = False


QueuedReason = Literal["created", "retry", "lease_expired", "preempted"]
CanceledReason = Literal["requested", "cancel_requested", "purged"]


class QueuedData(Accounted):
    """`queued`: created, back for a retry (with that attempt's error), or its lease lapsed."""

    kind = JobState.QUEUED.value
    reason: QueuedReason
    error: ErrorData | None = None


class PreemptedData(Payload):
    """`preempted`: its run stopped at a step boundary, checkpointed, for a waiting job.

    It is queued again at the head of its lane, its attempt not counted (the `queued` event before
    this one says `reason: preempted`).

    `for_job`: the interactive job it made room for; `preemptions`: how many times this job has
    been preempted, this one included (the script fills it in).
    """

    kind = "preempted"
    for_job: str | None = None
    preemptions: int | None = None


class StartData(Payload):
    """What a start's caller gives its `running` event: the node (the script adds the rest)."""

    kind = JobState.RUNNING.value
    node_id: str | None = None


class RunningData(StartData):
    """`running`: the node that started it, the attempt this is, and the lease's owner."""

    attempts: int
    owner: str


class SucceededData(Accounted):
    """`succeeded`: the record's outputs and the run's metrics."""

    kind = JobState.SUCCEEDED.value
    outputs: list[dict[str, Any]]
    metrics: dict[str, Any]


class FailedData(Accounted):
    """`failed`: why."""

    kind = JobState.FAILED.value
    error: ErrorData


class CanceledData(Accounted):
    """`canceled`: asked while queued (`requested`) or running (`cancel_requested`), or purged."""

    kind = JobState.CANCELED.value
    reason: CanceledReason


class ProgressData(Payload):
    """`progress`: a running job's stage (and step of total), or where a held job waits.

    A node writes a running job's stages (through its event sink); storage's `hold` writes a held
    job's first `waiting_in_node` (storage/leases.py `waiting_progress`).
    """

    kind = "progress"
    stage: str
    step: int | None = None
    total: int | None = None
    node: str | None = None  # waiting_in_node only: the node holding the queued job
    position: int | None = None  # waiting_in_node only: jobs that node starts before it


ExpiredReason = Literal["paused_retention"]


class ExpiredData(Accounted):
    """`expired`: its start_by passed before it started (no reason), or it stayed paused too long.

    `paused_retention`: paused `KILN_PAUSED_RETENTION_S`; its step checkpoints were deleted.
    """

    kind = JobState.EXPIRED.value
    reason: ExpiredReason | None = None


# `requested`: asked while queued; `pause_requested`: its run stopped at a step boundary for it
# (or a retry, a drain or a lapsed lease found the pause pending)
PausedReason = Literal["requested", "pause_requested"]


class PausedData(Accounted):
    """`paused`: it holds no GPU and no place in line; its step checkpoints are kept."""

    kind = JobState.PAUSED.value
    reason: PausedReason


class ResumedData(Payload):
    """`resumed`: a paused job is `queued` again, at the back of its lane (no fields)."""

    kind = "resumed"
