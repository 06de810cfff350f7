"""The job state machine: states, the one table of allowed transitions, terminal states."""

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


TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset(
        {JobState.RUNNING, JobState.CANCELED, JobState.EXPIRED, JobState.FAILED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELED, JobState.QUEUED}
    ),
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
