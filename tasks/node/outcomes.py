"""What one delivery of `run_job` did, and the Celery task state that says so (Flower shows it).

| the delivery                                         | Celery state | how                       |
|---|---|---|
| ran the job and it succeeded                         | SUCCESS      | returns `"succeeded"`     |
| ended the job `failed` (ran it, or refused it)       | FAILURE      | raises `JobFailedError`   |
| ended the job `canceled`, or found it canceled       | REVOKED      | `task-revoked` + `Ignore` |
| ended the job `expired`, or found it expired         | REVOKED      | the same, `expired=True`  |
| ran an attempt that failed, job queued again         | RETRY        | raises `Retry`            |
| handed the job back while draining                   | RETRY        | raises `Retry`            |
| suspended it for a waiting interactive job (queued)  | RETRY        | raises `Retry`            |
| stopped the job for its pause (the job is `paused`)  | SUCCESS      | returns `"paused"`        |
| re-published it (leased elsewhere), lost its lease,  | SUCCESS      | returns what it did       |
| or found it finished already                         |              |                           |

Every one of them is acknowledged once: `run_job` runs with late acknowledgement and
`acks_on_failure` (Celery's `task_acks_on_failure_or_timeout` semantics), so a task that ends in
FAILURE, RETRY or `Ignore` is acknowledged like one that returns, and never delivered again. The
retry of a job is a new message (a new task id) that the node published itself; Celery's own
retry machinery is not used. REVOKED is Celery's state for a task that will not run: the worker
announces it as its own `task-revoked` event (with task events on) and in the result backend
(none by default), then `Ignore` acknowledges the message without another state.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from celery.exceptions import Ignore, Retry

from kiln.common.stops import StopReason


class Delivery(StrEnum):
    """What one delivery of `run_job` did with its job.

    A delivery its job's stop ended is named by that `StopReason` (kiln/common/stops.py).
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = StopReason.CANCELED.value
    EXPIRED = StopReason.EXPIRED.value
    RETRYING = "retrying"  # this attempt failed retryably; the job is queued again
    HANDED_BACK = StopReason.HANDED_BACK.value  # the node drained; the job is queued again
    PREEMPTED = StopReason.PREEMPTED.value  # suspended for an interactive job; queued again
    PAUSED = StopReason.PAUSED.value  # its pause stopped it; the job is paused, checkpoint kept
    DEFERRED = "deferred"  # published again for later: a busy lease, a pause, Redis away
    LEASE_LOST = StopReason.LEASE_LOST.value  # another node took the job over mid-run
    DROPPED = "dropped"  # the job had finished already (or no longer exists)


@dataclass(frozen=True)
class DeliveryOutcome:
    """A `Delivery` with the job's error (FAILED, RETRYING, HANDED_BACK) and the retry delay."""

    kind: Delivery
    error: dict[str, Any] | None = None
    retry_in_s: float | None = None


class JobFailedError(Exception):
    """The job failed for good in this delivery; the task's FAILURE carries its error."""


class JobAttemptFailed(Exception):
    """This attempt of the job failed and the job was queued again; the task's RETRY cause."""


def describe_error(error: dict[str, Any] | None) -> str:
    """`type: message` of a job's error."""
    if not error:
        return "unknown error"
    return f"{error.get('type', 'error')}: {error.get('message', '')}"


def settle_task(task: Any, outcome: DeliveryOutcome) -> str:
    """End the running Celery `task` in the state its delivery's outcome calls for.

    Returns (SUCCESS, the delivery's kind as the result) or raises what Celery turns into
    FAILURE, RETRY or, through `Ignore`, a REVOKED task (see the module doc).
    """
    kind = outcome.kind
    if kind is Delivery.FAILED:
        raise JobFailedError(describe_error(outcome.error))
    if kind in (Delivery.CANCELED, Delivery.EXPIRED):
        announce_revoked(task, StopReason(kind.value))
        raise Ignore(str(kind))
    if kind in (Delivery.RETRYING, Delivery.HANDED_BACK, Delivery.PREEMPTED):
        cause = JobAttemptFailed(describe_error(outcome.error))
        when: Any = outcome.retry_in_s  # seconds (Celery's stubs want numbers.Real)
        raise Retry(str(kind), exc=cause, when=when)
    return str(kind)


def announce_revoked(task: Any, reason: StopReason) -> None:
    """Tell monitors (task event) and the result backend that the running task is REVOKED."""
    request = task.request
    expired = reason is StopReason.EXPIRED
    if task.app.conf.worker_send_task_events:
        task.send_event("task-revoked", terminated=False, signum=None, expired=expired)
    task.backend.mark_as_revoked(request.id, reason.value, request=request)
