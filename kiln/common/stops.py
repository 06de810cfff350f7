"""Why a job stops before it ends by itself: one type from the node's decision to the ranks.

The node decides (a cancel, a lost lease, a drain, the job's start_by) and keeps the reason on
the job it tracks; its `should_stop` hands that reason to the coordinator, which keeps it on the
request's ticket beside its own (a deadline, a refused start); the attempt's end and the Celery
task's state read the same value. gpu_worker, storage and tasks all import it from here.
"""

from __future__ import annotations

from enum import StrEnum


class StopReason(StrEnum):
    """Why a job's run stops early; what its record becomes follows from it."""

    CANCELED = "canceled"  # a cancel was requested: running → canceled
    EXPIRED = "expired"  # its start_by passed before it started: queued → expired
    LEASE_LOST = "lease_lost"  # another node holds the job now: its record is left to it
    HANDED_BACK = "handed_back"  # the node drains: running → queued, published again
    # a waiting interactive job needs its node: running → queued at the head of its lane,
    # checkpointed, its attempt not counted (tasks/control/preemption.py)
    PREEMPTED = "preempted"
    PAUSED = "paused"  # a pause was requested: running → paused, its checkpoint kept
    DEADLINE = "deadline"  # it ran past max_run_seconds: failed with DeadlineExceeded
    START_REFUSED = "start_refused"  # its caller refused its start (a batch's `batch_start`)
    REQUESTED = "requested"  # its caller's `should_stop` said stop without a reason of its own
