"""A submitted request as the coordinator tracks it (`Ticket`), and why the coordinator stops one.

Why a request stops is Kiln's one `StopReason` (kiln/common/stops.py): the caller's own reason,
which its `should_stop` returns (a plain True is `REQUESTED`), a refused start, or the deadline.

A ticket carries the caller's future and callbacks from `submit()` until the future is resolved,
whether that happens in the queue, on the group, or when the group dies. Callbacks never raise
into the coordinator: a failing one is logged.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TypeVar

from kiln.common.stops import StopReason
from kiln.gpu_worker.errors import DeadlineExceeded, GpuWorkerError, JobStopped
from kiln.gpu_worker.protocol import (
    GenerationRequest,
    GenerationResult,
    StepCheckpoint,
    StepProgress,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
# the caller's word, asked between steps: why to stop the request now (None or False: go on)
ShouldStop = Callable[[], StopReason | bool | None]


@dataclass(eq=False)
class Ticket:
    """One submitted request: its future, its callbacks and its deadline."""

    request: GenerationRequest
    future: Future[GenerationResult]
    enqueued_at: float
    on_progress: Callable[[StepProgress], None] | None = None
    should_stop: ShouldStop | None = None
    max_run_seconds: float | None = None
    stop_reason: StopReason | None = None
    on_checkpoint: Callable[[StepCheckpoint], None] | None = None

    @property
    def deadline_at(self) -> float | None:
        """`time.monotonic()` at which the request has run too long (counted from submit)."""
        if self.max_run_seconds is None:
            return None
        return self.enqueued_at + self.max_run_seconds

    def expired(self, now: float) -> bool:
        """True once `max_run_seconds` have passed since submit."""
        deadline = self.deadline_at
        return deadline is not None and deadline <= now

    def expired_in_queue_error(self) -> DeadlineExceeded:
        """The error of a request whose deadline passed before it could start."""
        return DeadlineExceeded(
            f"request {self.request.request_id} reached max_run_seconds="
            f"{self.max_run_seconds} before it could start"
        )

    def begin_running(self) -> bool:
        """Mark the future running as the request leaves the queue for the group.

        False when it must not run after all: its `should_stop` says stop (the future then fails
        with JobStopped) or the caller cancelled the future.
        """
        reason = self.wants_stop()
        if reason is not None:
            self.stop_reason = reason
            self.fail(JobStopped(f"request {self.request.request_id} stopped while queued"))
            return False
        return self.future.set_running_or_notify_cancel()

    def report(self, progress: StepProgress) -> None:
        """Call on_progress; a failing callback is logged, never propagated."""
        self._call_quietly("on_progress", self.on_progress, progress)

    def hand_checkpoint(self, checkpoint: StepCheckpoint) -> None:
        """Call on_checkpoint; a failing callback is logged (a checkpoint never fails a job)."""
        self._call_quietly("on_checkpoint", self.on_checkpoint, checkpoint)

    def _call_quietly(self, name: str, callback: Callable[[T], None] | None, value: T) -> None:
        if callback is None:
            return
        try:
            callback(value)
        except Exception:
            logger.exception("%s of request %s failed", name, self.request.request_id)

    def wants_stop(self) -> StopReason | None:
        """Call should_stop: why to stop, or None; a failing callback is 'keep going' (logged)."""
        if self.should_stop is None:
            return None
        try:
            answer = self.should_stop()
        except Exception:
            logger.exception("should_stop of request %s failed", self.request.request_id)
            return None
        if not answer:
            return None
        return answer if isinstance(answer, StopReason) else StopReason.REQUESTED

    def succeed(self, result: GenerationResult) -> None:
        """Resolve the future with the result, unless it is already resolved."""
        with contextlib.suppress(InvalidStateError):
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        """Resolve the future with an error, unless it is already resolved."""
        with contextlib.suppress(InvalidStateError):
            self.future.set_exception(error)

    def stopped_error(self) -> GpuWorkerError:
        """The error of a request the ranks stopped on the coordinator's word."""
        request_id = self.request.request_id
        if self.stop_reason is StopReason.DEADLINE:
            return DeadlineExceeded(
                f"request {request_id} ran past max_run_seconds={self.max_run_seconds}"
            )
        return JobStopped(f"request {request_id} was stopped by its should_stop callback")


# The caller's word on which requests of a batch start now (by request id); the rest must not run.
BatchStart = Callable[[Sequence[str]], Collection[str]]


def start_batch(batch: list[Ticket], batch_start: BatchStart | None) -> list[Ticket]:
    """The tickets of `batch` its caller lets start; the others fail with JobStopped.

    One call for the whole batch (the caller records every start in one round trip); a failing
    `batch_start` starts none of them (and is logged).
    """
    if batch_start is None or not batch:
        return batch
    try:
        allowed = set(batch_start([ticket.request.request_id for ticket in batch]))
    except Exception:
        logger.exception("batch_start of %d request(s) failed", len(batch))
        allowed = set()
    for ticket in batch:
        if ticket.request.request_id not in allowed:
            ticket.stop_reason = StopReason.START_REFUSED
            ticket.fail(JobStopped(f"request {ticket.request.request_id} was refused its start"))
    return [ticket for ticket in batch if ticket.request.request_id in allowed]
