"""The batch on the group (at most one at a time) and the handling of what rank 0 reports on it.

`InflightRequests` owns the running batch, the batch numbering and the progress counters. Its
`on_message` runs on the group's monitor thread: each handler takes what it needs under the
coordinator's lock, then reports progress and resolves futures outside it. Reports about a batch
that is no longer in flight (killed, failed) are dropped, but their shared-memory frames are
still unlinked. `police` runs on the dispatcher thread: deadlines, and ranks out of step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from kiln.common.ledger import shares, work_units
from kiln.common.stops import StopReason
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.counters import GroupCounters
from kiln.gpu_worker.energy import EnergyMeter
from kiln.gpu_worker.errors import JobFailed, UnsupportedRequest
from kiln.gpu_worker.failures import failure_error
from kiln.gpu_worker.group import GroupMessage
from kiln.gpu_worker.protocol import (
    AdapterState,
    BatchDone,
    BatchFailed,
    CoordinatorCommand,
    GenerationResult,
    RankFault,
    RequestOutputs,
    RequestRejected,
    StepDone,
    StepProgress,
    StopVerdict,
)
from kiln.gpu_worker.shm import discard_frames, read_frames
from kiln.gpu_worker.tickets import Ticket

# requests' charges kept until their caller takes them (`take_charge`); a caller that never does
# (a bench, a test) leaves at most this many behind, the oldest dropped first
CHARGES_KEPT = 4096

logger = logging.getLogger(__name__)

# Stops after which the request runs again elsewhere: rank 0 checkpoints the step it stops at
# (a drain hands the job back, a pause holds it, a priority preemption queues it again; it
# resumes on its next attempt having lost no step).
CHECKPOINTED_STOPS = frozenset({StopReason.HANDED_BACK, StopReason.PAUSED, StopReason.PREEMPTED})


@dataclass(eq=False)
class InflightBatch:
    """The batch the group is computing; at most one at a time."""

    batch_id: int
    tickets: dict[str, Ticket]
    started_at: float
    energy_at: float | None = None  # the devices' energy counter (J) as it started; None: unread
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


class Policing(NamedTuple):
    """What the dispatcher does about the running batch: stop some requests, or kill the group."""

    wake_at: float | None  # when to look again
    verdict: StopVerdict | None  # requests that just ran past their deadline
    kill_reason: str | None  # the group must go (a deadline or a desync outlived its grace)


class InflightRequests:
    """The requests on the group; guarded by the coordinator's lock (`cond`)."""

    def __init__(
        self,
        config: GroupConfig,
        cond: threading.Condition,
        send: Callable[[CoordinatorCommand], None],
    ) -> None:
        self._config = config
        self._cond = cond
        self._send = send  # to rank 0, for the per-step verdicts
        self.batch: InflightBatch | None = None
        self._batch_seq = 0
        self.batches_run = 0
        self.last_progress_at: float | None = None
        self.counters = GroupCounters()  # for the node's metrics (`Coordinator.counters`)
        self.adapters: dict[str, AdapterState] = {}  # per pipeline, as rank 0 last reported
        self.counters.devices = len(config.world())
        self._energy = EnergyMeter(config.world())
        # per request: its share of its batch's GPU-seconds and joules (None: not measured)
        self._charges: dict[str, tuple[float, float | None]] = {}

    def adapter_stats(self) -> dict[str, dict[str, object]]:
        """Per pipeline, its adapters loaded and fused on the ranks (for the heartbeat)."""
        return {name: asdict(state) for name, state in self.adapters.items()}

    # --- the dispatcher thread, under the lock ---------------------------------------------------

    def holds(self, request_id: str) -> bool:
        """True when a request with this id is in the running batch."""
        return bool(self.batch and request_id in self.batch.tickets)

    def running(self) -> int:
        """Requests of the running batch whose future is not resolved yet."""
        return len(self.batch.open_tickets()) if self.batch is not None else 0

    def open(self, tickets: list[Ticket]) -> InflightBatch:
        """Number a new batch of these tickets and hold it as the running one."""
        self._batch_seq += 1
        by_id = {ticket.request.request_id: ticket for ticket in tickets}
        self.batch = InflightBatch(self._batch_seq, by_id, time.monotonic(), self._energy.read_j())
        return self.batch

    def warm(self) -> None:
        """The group is ready: from now on its devices are held (the ledger's node totals)."""
        if self.counters.warm_at is None:
            self.counters.warm_at = time.monotonic()

    def take_charge(self, request_id: str) -> tuple[float, float | None]:
        """A finished request's GPU-seconds and joules (0.0 and None when it never ran)."""
        return self._charges.pop(request_id, (0.0, None))

    def _charge(self, batch: InflightBatch) -> None:
        """The batch left the group: its wall time × devices, shared among its requests.

        Every request of the batch is charged (succeeded, stopped, failed or refused a result):
        all of them held the devices, so the charges add up to the node's busy GPU-seconds.
        """
        seconds = time.monotonic() - batch.started_at
        self.counters.busy_s += seconds
        gpu_s = seconds * self.counters.devices
        self.counters.busy_gpu_s += gpu_s
        works = {
            request_id: work_units(
                ticket.request.num_outputs,
                ticket.request.width,
                ticket.request.height,
                ticket.request.num_frames,
            )
            for request_id, ticket in batch.tickets.items()
        }
        energy_now = self._energy.read_j()
        joules: dict[str, float] = {}
        if energy_now is not None and batch.energy_at is not None:
            joules = shares(max(0.0, energy_now - batch.energy_at), works)
        for request_id, share in shares(gpu_s, works).items():
            self._charges[request_id] = (share, joules.get(request_id))
        while len(self._charges) > CHARGES_KEPT:
            del self._charges[next(iter(self._charges))]

    def detach(self) -> InflightBatch | None:
        """Give up the running batch (its group died or is replaced); the caller fails it."""
        batch, self.batch = self.batch, None
        self.adapters.clear()  # the next group's ranks start with no adapter loaded
        if batch is not None:
            self._charge(batch)
        return batch

    def police(self, now: float) -> Policing:
        """Deadlines and desyncs of the running batch: what to stop, when to look again."""
        batch = self.batch
        if batch is None:
            return Policing(None, None, None)
        wake: list[float] = []
        newly: list[str] = []
        for ticket in batch.open_tickets():
            deadline = ticket.deadline_at
            if deadline is None:
                continue
            if ticket.stop_reason is None and deadline <= now:
                ticket.stop_reason = StopReason.DEADLINE
                newly.append(ticket.request.request_id)
            if ticket.stop_reason is StopReason.DEADLINE:
                wake.append(deadline + self._config.deadline_grace_s)
            else:
                wake.append(deadline)
        if batch.first_fault_at is not None:
            wake.append(batch.first_fault_at + self._config.desync_grace_s)
        if wake and min(wake) <= now:
            return Policing(None, None, batch.kill_reason())
        verdict = StopVerdict(batch.batch_id, -1, frozenset(newly)) if newly else None
        return Policing(min(wake) if wake else None, verdict, None)

    # --- the group's monitor thread --------------------------------------------------------------

    def on_message(self, message: GroupMessage) -> None:
        """Handle one report of the current group about the running batch."""
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

    def _current(self, batch_id: int) -> InflightBatch | None:
        batch = self.batch
        return batch if batch is not None and batch.batch_id == batch_id else None

    def _on_step(self, message: StepDone) -> None:
        with self._cond:
            batch = self._current(message.batch_id)
            if batch is None:
                return
            self.last_progress_at = time.time()
            tickets = batch.open_tickets()
        step, total = message.step, message.total
        stop: set[str] = set()
        checkpoint: set[str] = set()
        for ticket in tickets:
            ticket.report(StepProgress("denoising", step, total))
            if step >= total:
                ticket.report(StepProgress("decoding", total, total))
            if ticket.stop_reason is None:
                ticket.stop_reason = ticket.wants_stop()
                if ticket.stop_reason is not None and step < total:
                    # The operator's record of a stop (a drain's "which step did it stop at"):
                    # rank 0 reads this verdict at the end of the next step and stops there.
                    logger.info(
                        "request %s stops at the end of step %d of %d (%s)",
                        ticket.request.request_id,
                        step + 1,
                        total,
                        ticket.stop_reason,
                    )
            if ticket.stop_reason is not None:
                stop.add(ticket.request.request_id)
            if ticket.stop_reason in CHECKPOINTED_STOPS:
                checkpoint.add(ticket.request.request_id)
        # Sent every step, stop or not: rank 0 waits for the verdict on step k before it
        # decides at the end of step k+1.
        self._send(StopVerdict(message.batch_id, step, frozenset(stop), frozenset(checkpoint)))

    def _finish(self, batch_id: int) -> InflightBatch | None:
        """Take the batch rank 0 reported the end of (None if it is no longer in flight)."""
        with self._cond:
            batch = self._current(batch_id)
            if batch is not None:
                self.batch = None
                self.batches_run += 1
                self._charge(batch)
                self._cond.notify_all()
            return batch

    def _on_done(self, message: BatchDone) -> None:
        batch = self._finish(message.batch_id)
        if batch is None:
            discard_outputs(message.outputs)
            return
        metrics = message.metrics
        pipeline = next(iter(batch.tickets.values())).request.pipeline
        with self._cond:
            self.counters.add_forward(
                pipeline, metrics.steps_run, metrics.batch_size, metrics.peak_memory_mb
            )
            if message.adapters is not None:
                self.adapters[pipeline] = message.adapters
        frames = _read_outputs(message.outputs)
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
        batch = self._finish(message.batch_id)
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
            batch = self.batch
            if batch is None or message.batch_id not in (None, batch.batch_id):
                return
            batch.faults.append(message)
            if not message.fatal and batch.first_fault_at is None:
                # If rank 0 does not report this batch soon, the ranks are out of step.
                batch.first_fault_at = time.monotonic()
                self._cond.notify_all()


def _read_outputs(outputs: tuple[RequestOutputs, ...]) -> dict[str, list[np.ndarray]]:
    """Each request's frames out of shared memory; a request whose frames are lost is left out."""
    frames: dict[str, list[np.ndarray]] = {}
    for request_outputs in outputs:
        try:
            frames[request_outputs.request_id] = [read_frames(d) for d in request_outputs.frames]
        except OSError as exc:
            discard_outputs((request_outputs,))
            logger.error("frames of %s were lost: %s", request_outputs.request_id, exc)
    return frames


def discard_outputs(outputs: tuple[RequestOutputs, ...]) -> None:
    """Unlink the shared-memory frames of outputs nobody will read."""
    for request_outputs in outputs:
        for descriptor in request_outputs.frames:
            discard_frames(descriptor)
