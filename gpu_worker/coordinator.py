"""The coordinator: a thread-safe front of one worker group, with batching and recovery.

It holds three collaborators, each with its own state, all guarded by the coordinator's one lock
(a decision often reads more than one of them): `WaitingRequests` (gpu_worker.batching: the queue
and what goes next), `InflightRequests` (gpu_worker.inflight: the batch on the group and rank 0's
reports about it) and `GroupSlot` (gpu_worker.group_slot: the current group and why it must be
replaced).

Threads: callers `submit()` from any thread; one dispatcher thread forms batches, enforces
deadlines, and is the only thread that starts, kills and rebuilds the group (a rank's
PR_SET_PDEATHSIG is tied to the thread that spawned it, so that thread lives as long as the
coordinator); the group's monitor thread delivers rank 0's messages and deaths. User callbacks
(`on_progress`, `should_stop`) run on the monitor thread, `should_stop` and the `batch_start` hook
also on the dispatcher thread as a batch leaves for the ranks; never under the coordinator's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from kiln.common.limits import DeclaredLimits
from kiln.common.request import InputSchema, pipeline_takes_checkpoints
from kiln.gpu_worker.batching import WaitingRequests
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.counters import (
    REBUILD_DIED,
    REBUILD_KILLED,
    REBUILD_START_FAILED,
    GroupCounters,
)
from kiln.gpu_worker.errors import GpuWorkerError, UnsupportedRequest, WorkerGroupDied
from kiln.gpu_worker.failures import death_error
from kiln.gpu_worker.group import GroupMessage, WorkerGroup
from kiln.gpu_worker.group_slot import GroupSlot
from kiln.gpu_worker.inflight import InflightBatch, InflightRequests, discard_outputs
from kiln.gpu_worker.protocol import (
    BatchDone,
    CoordinatorCommand,
    GenerationRequest,
    GenerationResult,
    GroupAsleep,
    RunBatch,
    StepCheckpoint,
    StepPreview,
    StepProgress,
    StopVerdict,
)
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.gpu_worker.sleep import IdleSleep
from kiln.gpu_worker.tickets import BatchStart, ShouldStop, Ticket, start_batch

logger = logging.getLogger(__name__)

__all__ = ["Coordinator", "GroupConfig"]


class Coordinator:
    """Runs generation requests on one worker group; `start()`, `submit()`, `shutdown()`."""

    def __init__(self, config: GroupConfig) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._closing = False
        self._waiting = WaitingRequests(config.max_batch, config.batch_window_s)
        self._inflight = InflightRequests(config, self._cond, self._send)
        self._slot = GroupSlot(config, self._cond)
        settings = config.settings or GpuWorkerSettings()
        self._idle = IdleSleep(settings.idle_sleep_s, settings.sleep_mode)  # gpu_worker/sleep.py
        self._warming = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._batch_start: BatchStart | None = None

    def start(self) -> None:
        """Spawn the group, load and warm up every pipeline; raise `RankStartupFailed`."""
        if self._thread is not None:
            raise RuntimeError("the coordinator was already started")
        self._thread = threading.Thread(target=self._run, name="kiln-dispatcher", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def submit(
        self,
        request: GenerationRequest,
        on_progress: Callable[[StepProgress], None] | None = None,
        should_stop: ShouldStop | None = None,
        max_run_seconds: float | None = None,
        on_checkpoint: Callable[[StepCheckpoint], None] | None = None,
    ) -> Future[GenerationResult]:
        """Queue a request; `max_run_seconds` counts from this call.

        `on_checkpoint` gets each step checkpoint rank 0 takes of a request with a
        `CheckpointPlan` (on the monitor thread, like `on_progress`: hand it on, do not write).

        The future raises JobFailed (and subclasses), JobStopped or WorkerGroupDied.
        """
        future: Future[GenerationResult] = Future()
        if request.checkpoint is not None and not self.takes_checkpoints(request.pipeline):
            # its pipeline's loop cannot resume: no plan, so it batches with others as before
            request = replace(request, checkpoint=None)
        if request.pipeline not in self.config.pipelines:
            served = sorted(self.config.pipelines)
            future.set_exception(
                UnsupportedRequest(f"pipeline: {request.pipeline!r} is not served here ({served})")
            )
            return future
        ticket = Ticket(
            request,
            future,
            time.monotonic(),
            on_progress,
            should_stop,
            max_run_seconds,
            on_checkpoint=on_checkpoint,
        )
        with self._cond:
            if not self._started.is_set() or self._closing:
                raise RuntimeError("submit() needs a started coordinator that is not shut down")
            request_id = request.request_id
            if self._waiting.holds(request_id) or self._inflight.holds(request_id):
                raise ValueError(f"request {request_id} is already queued or running")
            self._waiting.add(ticket)
            self._cond.notify_all()
        return future

    def set_batch_start(self, batch_start: BatchStart | None) -> None:
        """Ask `batch_start` which requests of each batch start, as it leaves for the ranks.

        It gets the batch's request ids (on the dispatcher thread, once per batch) and returns
        those that start; the others do not run: their futures raise JobStopped.
        """
        self._batch_start = batch_start

    def pipelines(self) -> list[str]:
        """Names of the pipelines this coordinator serves."""
        return sorted(self.config.pipelines)

    def pipeline_limits(self) -> dict[str, DeclaredLimits]:
        """What each pipeline declares it takes, as rank 0 loaded it (empty before `start`)."""
        with self._cond:
            return dict(self._slot.limits)

    def pipeline_inputs(self) -> dict[str, InputSchema]:
        """Input schemas of the pipelines that declare one, as rank 0 loaded them."""
        with self._cond:
            return dict(self._slot.input_schemas)

    def takes_checkpoints(self, pipeline: str) -> bool:
        """Whether `pipeline` announced step checkpoints (`x-kiln-checkpoints`) on rank 0."""
        return pipeline_takes_checkpoints(self.pipeline_inputs(), pipeline)

    def stats(self) -> dict[str, Any]:
        """Counters for heartbeats and health checks."""
        with self._cond:
            group = self._slot.group
            return {
                "jobs_queued": len(self._waiting),
                "jobs_running": self._inflight.running(),
                "last_progress_at": self._inflight.last_progress_at,
                "rebuilds": self._slot.rebuilds,
                "batches_run": self._inflight.batches_run,
                "group_alive": bool(group is not None and group.alive),
                "world_size": len(self.config.world()),
                "pids": group.pids if group is not None else [],
                "pipelines": self.pipelines(),
                "adapters": self._inflight.adapter_stats(),
                "warming": self._warming,
                **self._idle.stats(),
            }

    def counters(self) -> GroupCounters:
        """A copy of the cumulative work counters (busy time, steps, batch sizes, rebuilds)."""
        with self._cond:
            return self._inflight.counters.snapshot()

    def take_charge(self, request_id: str) -> tuple[float, float | None]:
        """A finished request's share of its batch's GPU-seconds and joules (kiln/common/ledger.py).

        Set as its batch leaves the group, before its future is resolved; taken once (0.0 and
        None for a request that never ran on the group).
        """
        with self._cond:
            return self._inflight.take_charge(request_id)

    def shutdown(self) -> None:
        """Fail what is queued or running with WorkerGroupDied and stop the group; idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # --- the dispatcher thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._build_group()
        except BaseException as exc:
            with self._cond:
                self._closing = True
            self._start_error = exc
            self._started.set()
            return
        with self._cond:
            self._inflight.warm()  # its devices are held from here: the ledger's node total
        self._started.set()
        try:
            while self._dispatch_once():
                pass
        finally:
            self._teardown()

    def _dispatch_once(self) -> bool:
        if self._needs_rebuild():
            self._rebuild()
            return True
        with self._cond:
            if self._closing:
                return False
            now = time.monotonic()
            self._waiting.expire(now)
            verdict: StopVerdict | None = None
            batch: list[Ticket] = []
            if self._inflight.batch is not None:
                wake_at, verdict = self._police(now)
                # a waiting request whose deadline passes meanwhile fails then, not once the
                # running batch ends (which, for a long or hung one, may be much later)
                queued_deadline = self._waiting.next_deadline()
                if queued_deadline is not None:
                    wake_at = min(queued_deadline, wake_at or queued_deadline)
            else:
                batch, wake_at = self._waiting.take_batch(now, self._slot.limits)
            idle = not batch and self._inflight.batch is None and not self._waiting
            sleep, wake_at = self._idle.due(now, idle and self._slot.group is not None, wake_at)
            if not batch and verdict is None and sleep is None and self._slot.kill_reason is None:
                self._cond.wait(None if wake_at is None else max(0.0, wake_at - now))
                return True
        if sleep is not None:
            self._send(sleep)
        if verdict is not None:
            self._send(verdict)
        if batch:
            self._dispatch(batch)
        return True

    def _police(self, now: float) -> tuple[float | None, StopVerdict | None]:
        policing = self._inflight.police(now)
        if policing.kill_reason is not None:
            # The next turn of the loop kills the group and fails the batch (see _rebuild).
            self._slot.kill_reason = policing.kill_reason
        return policing.wake_at, policing.verdict

    def _dispatch(self, planned: list[Ticket]) -> None:
        batch = [ticket for ticket in planned if ticket.begin_running()]
        batch = start_batch(batch, self._batch_start)  # the caller's word, one call per batch
        if not batch:
            return
        with self._cond:
            inflight = self._inflight.open(batch)
            group = self._slot.group
            self._idle.note_dispatch()  # the ranks wake for this batch if they slept
        self._send(RunBatch(inflight.batch_id, tuple(t.request for t in batch)), group)

    def _send(self, command: CoordinatorCommand, group: WorkerGroup | None = None) -> None:
        """Send to rank 0; a dead group is noted for the dispatcher to rebuild."""
        with self._cond:
            target = group or self._slot.group
        if target is None:
            return
        try:
            target.send(command)
        except WorkerGroupDied as exc:
            with self._cond:
                if not self._closing and self._slot.note_unreachable(target, str(exc)):
                    self._cond.notify_all()

    # --- group lifecycle (dispatcher thread only) ------------------------------------------------

    def _needs_rebuild(self) -> bool:
        with self._cond:
            if self._closing:
                return False
            if self._slot.must_replace():
                return True
            return self._slot.group is None and bool(self._waiting)

    def _rebuild(self) -> None:
        with self._cond:
            why = _rebuild_reason(self._slot)
            old, reason = self._slot.detach()
            inflight = self._inflight.detach()
        if old is not None:
            old.kill()
        if inflight is not None:
            _fail_open(inflight, reason)
        try:
            self._build_group()
        except GpuWorkerError as exc:
            self._fail_queued(exc)
            return
        with self._cond:
            self._slot.rebuilds += 1
            self._inflight.counters.add_rebuild(why)

    def _build_group(self) -> None:
        with self._cond:
            self._warming = True  # heartbeat: starting, loading, warming up
        try:
            self._slot.build(self._on_group_message, self._on_group_death)
        finally:
            with self._cond:
                self._warming = False
                self._idle.note_new_group()

    def _fail_queued(self, error: BaseException) -> None:
        with self._cond:
            queued = self._waiting.drain()
        for ticket in queued:
            ticket.fail(error)

    def _teardown(self) -> None:
        with self._cond:
            group, _ = self._slot.detach()
            inflight = self._inflight.detach()
        closed = WorkerGroupDied("the coordinator was shut down")
        self._fail_queued(closed)
        if inflight is not None:
            for ticket in inflight.open_tickets():
                ticket.fail(closed)
        if group is not None:
            group.shutdown()

    # --- the group's monitor thread --------------------------------------------------------------

    def _on_group_message(self, generation: int, message: GroupMessage) -> None:
        with self._cond:
            stale = not self._slot.is_current(generation)
            if isinstance(message, GroupAsleep):
                if not stale:
                    self._idle.on_report(message)
                return
        if stale:
            if isinstance(message, BatchDone):
                discard_outputs(message.outputs)
            return
        if isinstance(message, StepPreview):
            self._on_preview(message)
            return
        if isinstance(message, StepCheckpoint):
            self._on_checkpoint(message)
            return
        self._inflight.on_message(message)

    def _on_preview(self, message: StepPreview) -> None:
        """Hand a preview to its request's `on_progress` (as `StepProgress.preview`)."""
        ticket = self._running_ticket(message.batch_id, message.request_id)
        if ticket is None:
            return
        progress = StepProgress("denoising", message.step, message.total, message.pixels)
        ticket.report(progress)

    def _on_checkpoint(self, message: StepCheckpoint) -> None:
        """Hand a step checkpoint to its request's `on_checkpoint` (the node writes it)."""
        ticket = self._running_ticket(message.batch_id, message.request_id)
        if ticket is not None:
            ticket.hand_checkpoint(message)

    def _running_ticket(self, batch_id: int, request_id: str) -> Ticket | None:
        """The ticket of `request_id` while its batch `batch_id` runs and it is not done."""
        with self._cond:
            batch = self._inflight.batch
            current = batch is not None and batch.batch_id == batch_id
            ticket = batch.tickets.get(request_id) if batch and current else None
        if ticket is None or ticket.future.done():
            return None
        return ticket

    def _on_group_death(self, generation: int, reason: str) -> None:
        with self._cond:
            if not self._slot.is_current(generation) or self._closing:
                return
            self._slot.dead_reason = reason
            inflight = self._inflight.detach()
            self._cond.notify_all()
        if inflight is not None:
            _fail_open(inflight, reason)


def _rebuild_reason(slot: GroupSlot) -> str:
    """Why the dispatcher replaces the group in `slot` (read before `detach` clears it)."""
    if slot.kill_reason is not None:
        return REBUILD_KILLED
    if slot.dead_reason is not None:
        return REBUILD_DIED
    return REBUILD_START_FAILED


def _fail_open(batch: InflightBatch, reason: str) -> None:
    """Fail the unresolved requests of a batch whose group died or was killed under it."""
    for ticket in batch.open_tickets():
        ticket.fail(death_error(ticket, batch.faults, reason))
