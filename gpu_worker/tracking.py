"""The coordinator's bookkeeping of one request (`Ticket`) and of the batch on the group.

Also the translation of rank failures into the caller's exceptions: the types in
`gpu_worker.errors`, with an out-of-memory message that says what to change.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from enum import StrEnum

from gpu_worker.errors import (
    DeadlineExceeded,
    GpuWorkerError,
    JobFailed,
    JobStopped,
    OutOfMemory,
    WorkerGroupDied,
)
from gpu_worker.protocol import (
    FailureKind,
    GenerationRequest,
    GenerationResult,
    Progress,
    RankFault,
)

logger = logging.getLogger(__name__)

OOM_ADVICE = (
    "Out of memory while generating {what}. The request does not fit on this worker group as it "
    "is; try one or more of: a lower width/height, fewer num_frames, fewer num_outputs, a smaller "
    "batch (max_batch) on this node, enabling CPU offload for the model, or a group with more "
    "GPUs (batch or context parallelism spreads the work). Device error: {detail}"
)


class StopReason(StrEnum):
    """Why the coordinator asked the ranks to stop a request."""

    STOPPED = "stopped"  # its should_stop said so
    DEADLINE = "deadline"  # it ran past max_run_seconds


@dataclass(eq=False)
class Ticket:
    """One submitted request: its future, its callbacks and its deadline."""

    request: GenerationRequest
    future: Future[GenerationResult]
    enqueued_at: float
    on_progress: Callable[[Progress], None] | None = None
    should_stop: Callable[[], bool] | None = None
    max_run_seconds: float | None = None
    stop_reason: StopReason | None = None

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

    def report(self, progress: Progress) -> None:
        """Call on_progress; a failing callback is logged, never propagated."""
        if self.on_progress is None:
            return
        try:
            self.on_progress(progress)
        except Exception:
            logger.exception("on_progress of request %s failed", self.request.request_id)

    def wants_stop(self) -> bool:
        """Call should_stop; a failing callback counts as 'keep going' (and is logged)."""
        if self.should_stop is None:
            return False
        try:
            return bool(self.should_stop())
        except Exception:
            logger.exception("should_stop of request %s failed", self.request.request_id)
            return False

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


@dataclass(eq=False)
class InflightBatch:
    """The batch the group is computing; at most one at a time."""

    batch_id: int
    tickets: dict[str, Ticket]
    started_at: float
    faults: list[RankFault] = field(default_factory=list)
    first_fault_at: float | None = None

    def open_tickets(self) -> list[Ticket]:
        """Tickets whose future is not resolved yet."""
        return [ticket for ticket in self.tickets.values() if not ticket.future.done()]

    def kill_reason(self) -> str:
        """Why the coordinator gives up on this batch and kills the group under it."""
        if self.first_fault_at is not None:
            ranks = sorted({fault.rank for fault in self.faults})
            return f"rank(s) {ranks} failed alone and the other ranks did not come back; killed"
        return "a request ran past its deadline and did not stop within the grace; killed"


def describe_request(request: GenerationRequest) -> str:
    """'2 output(s) of 512x512, 16 frame(s), 30 steps' — for error messages."""
    return (
        f"{request.num_outputs} output(s) of {request.width}x{request.height}, "
        f"{request.num_frames} frame(s), {request.steps} steps"
    )


def failure_error(kind: FailureKind, message: str, request: GenerationRequest) -> GpuWorkerError:
    """The caller's exception for a forward that failed with `kind` on the ranks."""
    if kind is FailureKind.OOM:
        detail = message.strip().splitlines()[-1] if message.strip() else "out of memory"
        return OutOfMemory(OOM_ADVICE.format(what=describe_request(request), detail=detail))
    if kind is FailureKind.COLLECTIVE:
        return WorkerGroupDied(f"the worker group broke during the forward:\n{message}")
    return JobFailed(f"the pipeline failed:\n{message}")


def death_error(ticket: Ticket, batch: InflightBatch, reason: str) -> GpuWorkerError:
    """The error of an in-flight request whose group died (or was killed) under it."""
    if ticket.stop_reason is StopReason.DEADLINE:
        return ticket.stopped_error()
    cause = next((f for f in batch.faults if f.kind is not FailureKind.COLLECTIVE), None)
    if cause is not None:  # a rank failed on its own first; the death followed from it
        return failure_error(cause.kind, f"rank {cause.rank}: {cause.message}", ticket.request)
    fatal = [f"rank {f.rank}: {_last_line(f.message)}" for f in batch.faults if f.fatal]
    details = "".join(f"\n{line}" for line in fatal)
    return WorkerGroupDied(f"the worker group died: {reason}{details}")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no message)"
