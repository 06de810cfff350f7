"""The job state machine (states, allowed transitions, terminal states) and the batch statuses.

The Lua scripts take their state names from here too: storage/scripts.py prepends a table of them
(`S.queued`, `B.paused`, `TERMINAL`) to every script it loads.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """Where a job is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"
    # asked to pause: no GPU, its step checkpoints kept; resumed to `queued`, or expired once it
    # has been paused `KILN_PAUSED_RETENTION_S` (docs/contract.md §4a)
    PAUSED = "paused"


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset(
        {JobState.RUNNING, JobState.CANCELED, JobState.EXPIRED, JobState.FAILED, JobState.PAUSED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.QUEUED, JobState.PAUSED}
    ),
    JobState.PAUSED: frozenset({JobState.QUEUED, JobState.CANCELED, JobState.EXPIRED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELED: frozenset(),
    JobState.EXPIRED: frozenset(),
}

TERMINAL_STATES: frozenset[JobState] = frozenset(s for s, nxt in TRANSITIONS.items() if not nxt)


def allowed(source: JobState, target: JobState) -> bool:
    """True if the table allows `source → target`."""
    return target in TRANSITIONS[source]


def edge_sources(sources: tuple[JobState, ...], target: JobState) -> tuple[JobState, ...]:
    """Return `sources` after checking each `source → target` is in the table (import time)."""
    for source in sources:
        if not allowed(source, target):
            raise AssertionError(f"{source} -> {target} is not in TRANSITIONS")
    return sources


def is_terminal(status: str) -> bool:
    """Whether a job status, or a job event's type, is final: nothing follows it.

    Takes plain strings too (a JSON body, an event type): a `JobState` hashes as its value.
    """
    return status in TERMINAL_STATES


class BatchStatus(StrEnum):
    """Where a batch is: running (⇄ paused) → finalizing → completed, canceled, expired, failed.

    `failed`: its input could not be read (the view's `error` says why); the lines fed before
    ran to their end, the others have no result line.
    """

    validating = "validating"
    running = "running"
    paused = "paused"
    finalizing = "finalizing"
    completed = "completed"
    canceled = "canceled"
    expired = "expired"
    failed = "failed"


FINAL_BATCH_STATUSES: frozenset[BatchStatus] = frozenset(
    {BatchStatus.completed, BatchStatus.canceled, BatchStatus.expired, BatchStatus.failed}
)


def is_final_batch(status: str) -> bool:
    """Whether a batch status is final."""
    return status in FINAL_BATCH_STATUSES
