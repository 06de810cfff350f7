"""The coordinator's state and the handlers of what its worker group reports.

Handlers run on the group's monitor thread. Each takes what it needs under the lock and calls
user callbacks and resolves futures outside it. Messages of an older group generation, or of a
batch that is no longer in flight (killed, failed), are dropped, but their shared-memory frames
are still unlinked.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from gpu_worker.config import GroupConfig
from gpu_worker.errors import JobFailed, UnsupportedRequest, WorkerGroupDied
from gpu_worker.group import GroupMessage, WorkerGroup
from gpu_worker.protocol import (
    BatchDone,
    BatchFailed,
    CoordinatorCommand,
    GenerationResult,
    Progress,
    RankFault,
    RequestOutputs,
    RequestRejected,
    StepDone,
    StopVerdict,
)
from gpu_worker.shm import discard_frames, read_frames
from gpu_worker.tracking import InflightBatch, StopReason, death_error, failure_error

logger = logging.getLogger(__name__)


class GroupEvents:
    """Shared coordinator state plus the monitor-thread side of the coordinator."""

    def __init__(self, config: GroupConfig) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._closing = False
        self._group: WorkerGroup | None = None
        self._generation = 0
        self._inflight: InflightBatch | None = None
        self._batch_seq = 0
        self._kill_reason: str | None = None
        self._dead_reason: str | None = None
        self._rebuilds = 0
        self._batches_run = 0
        self._last_progress_at: float | None = None

    def _send(self, command: CoordinatorCommand, group: WorkerGroup | None = None) -> None:
        """Send to rank 0; a dead group is noted for the dispatcher to rebuild."""
        with self._cond:
            target = group or self._group
        if target is None:
            return
        try:
            target.send(command)
        except WorkerGroupDied as exc:
            with self._cond:
                if target is self._group and self._dead_reason is None and not self._closing:
                    self._dead_reason = str(exc)
                    self._cond.notify_all()

    def _current(self, batch_id: int) -> InflightBatch | None:
        batch = self._inflight
        return batch if batch is not None and batch.batch_id == batch_id else None

    def _on_group_message(self, generation: int, message: GroupMessage) -> None:
        with self._cond:
            stale = generation != self._generation
        if stale:
            if isinstance(message, BatchDone):
                _discard(message.outputs)
            return
        if isinstance(message, StepDone):
            self._on_step(message)
        elif isinstance(message, BatchDone):
            self._on_done(message)
        elif isinstance(message, BatchFailed):
            self._on_failed(message)
        elif isinstance(message, RequestRejected):
            self._on_rejected(message)
        elif isinstance(message, RankFault):
            self._on_fault(message)

    def _on_step(self, message: StepDone) -> None:
        with self._cond:
            batch = self._current(message.batch_id)
            if batch is None:
                return
            self._last_progress_at = time.time()
            tickets = batch.open_tickets()
        step, total = message.step, message.total
        stop: set[str] = set()
        for ticket in tickets:
            ticket.report(Progress("denoising", step, total))
            if step >= total:
                ticket.report(Progress("decoding", total, total))
            if ticket.stop_reason is None and ticket.wants_stop():
                ticket.stop_reason = StopReason.STOPPED
            if ticket.stop_reason is not None:
                stop.add(ticket.request.request_id)
        # Sent every step, stop or not: rank 0 waits for the verdict on step k before it
        # decides at the end of step k+1.
        self._send(StopVerdict(message.batch_id, step, frozenset(stop)))

    def _take(self, batch_id: int) -> InflightBatch | None:
        with self._cond:
            batch = self._current(batch_id)
            if batch is not None:
                self._inflight = None
                self._batches_run += 1
                self._cond.notify_all()
            return batch

    def _on_done(self, message: BatchDone) -> None:
        batch = self._take(message.batch_id)
        if batch is None:
            _discard(message.outputs)
            return
        frames: dict[str, list[np.ndarray]] = {}
        for outputs in message.outputs:
            try:
                frames[outputs.request_id] = [read_frames(d) for d in outputs.frames]
            except OSError as exc:
                _discard((outputs,))
                logger.error("frames of %s were lost: %s", outputs.request_id, exc)
        for ticket in batch.open_tickets():
            request_id = ticket.request.request_id
            if request_id in message.stopped:
                ticket.fail(ticket.stopped_error())
            elif request_id in frames:
                result = GenerationResult(request_id, frames[request_id], message.metrics)
                ticket.succeed(result)
            else:
                ticket.fail(JobFailed(f"rank 0 returned no outputs for request {request_id}"))

    def _on_failed(self, message: BatchFailed) -> None:
        batch = self._take(message.batch_id)
        if batch is None:
            return
        for ticket in batch.open_tickets():
            ticket.fail(failure_error(message.kind, message.message, ticket.request))

    def _on_rejected(self, message: RequestRejected) -> None:
        with self._cond:
            batch = self._current(message.batch_id)
            ticket = batch.tickets.get(message.request_id) if batch is not None else None
        if ticket is not None:
            ticket.fail(UnsupportedRequest(message.message))

    def _on_fault(self, message: RankFault) -> None:
        with self._cond:
            batch = self._inflight
            if batch is None or message.batch_id not in (None, batch.batch_id):
                return
            batch.faults.append(message)
            if not message.fatal and batch.first_fault_at is None:
                # If rank 0 does not report this batch soon, the ranks are out of step.
                batch.first_fault_at = time.monotonic()
                self._cond.notify_all()

    def _group_died(self, generation: int, reason: str) -> None:
        with self._cond:
            if generation != self._generation or self._closing:
                return
            self._dead_reason = reason
            batch, self._inflight = self._inflight, None
            self._cond.notify_all()
        if batch is not None:
            for ticket in batch.open_tickets():
                ticket.fail(death_error(ticket, batch, reason))


def _discard(outputs: tuple[RequestOutputs, ...]) -> None:
    for request_outputs in outputs:
        for descriptor in request_outputs.frames:
            discard_frames(descriptor)
