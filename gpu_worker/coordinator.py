"""The coordinator: a thread-safe front of one worker group, with batching and recovery.

Threads: callers `submit()` from any thread; one dispatcher thread forms batches, enforces
deadlines, and is the only thread that starts, kills and rebuilds the group (a rank's
PR_SET_PDEATHSIG is tied to the thread that spawned it, so that thread lives as long as the
coordinator); the group's monitor thread delivers rank 0's messages and deaths to the handlers in
`gpu_worker.coordinator_events`. User callbacks (`on_progress`, `should_stop`) run on the monitor
thread, never under the coordinator's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from gpu_worker.batching import plan_batch, window_remaining
from gpu_worker.config import GroupConfig
from gpu_worker.coordinator_events import GroupEvents
from gpu_worker.errors import (
    GpuWorkerError,
    JobStopped,
    RankStartupFailed,
    UnsupportedRequest,
    WorkerGroupDied,
)
from gpu_worker.group import WorkerGroup
from gpu_worker.limits import DeclaredLimits
from gpu_worker.protocol import (
    GenerationRequest,
    GenerationResult,
    Progress,
    RunBatch,
    StopVerdict,
)
from gpu_worker.tracking import InflightBatch, StopReason, Ticket, death_error

logger = logging.getLogger(__name__)

__all__ = ["Coordinator", "GroupConfig"]


class Coordinator(GroupEvents):
    """Runs generation requests on one worker group; `start()`, `submit()`, `shutdown()`."""

    def __init__(self, config: GroupConfig) -> None:
        super().__init__(config)
        self._queue: deque[Ticket] = deque()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._limits: dict[str, DeclaredLimits] = {}

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
        on_progress: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        max_run_seconds: float | None = None,
    ) -> Future[GenerationResult]:
        """Queue a request; the future raises JobFailed (and subclasses), JobStopped or
        WorkerGroupDied. `max_run_seconds` counts from this call."""
        future: Future[GenerationResult] = Future()
        if request.pipeline not in self.config.pipelines:
            served = sorted(self.config.pipelines)
            future.set_exception(
                UnsupportedRequest(f"pipeline: {request.pipeline!r} is not served here ({served})")
            )
            return future
        ticket = Ticket(
            request, future, time.monotonic(), on_progress, should_stop, max_run_seconds
        )
        with self._cond:
            if not self._started.is_set() or self._closing:
                raise RuntimeError("submit() needs a started coordinator that is not shut down")
            if self._is_known(request.request_id):
                raise ValueError(f"request {request.request_id} is already queued or running")
            self._queue.append(ticket)
            self._cond.notify_all()
        return future

    def pipelines(self) -> list[str]:
        """Names of the pipelines this coordinator serves."""
        return sorted(self.config.pipelines)

    def pipeline_limits(self) -> dict[str, DeclaredLimits]:
        """What each pipeline declares it takes, as rank 0 loaded it (empty before `start`)."""
        with self._cond:
            return dict(self._limits)

    def stats(self) -> dict[str, Any]:
        """Counters for heartbeats and health checks."""
        with self._cond:
            group = self._group
            return {
                "jobs_queued": len(self._queue),
                "jobs_running": len(self._inflight.open_tickets()) if self._inflight else 0,
                "last_progress_at": self._last_progress_at,
                "rebuilds": self._rebuilds,
                "batches_run": self._batches_run,
                "group_alive": bool(group is not None and group.alive),
                "world_size": len(self.config.world()),
                "pids": group.pids if group is not None else [],
                "pipelines": self.pipelines(),
            }

    def shutdown(self) -> None:
        """Fail what is queued or running with WorkerGroupDied and stop the group; idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # --- the dispatcher thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._build_group()
        except BaseException as exc:
            with self._cond:
                self._closing = True
            self._start_error = exc
            self._started.set()
            return
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
            self._expire_queued(now)
            verdict: StopVerdict | None = None
            batch: list[Ticket] = []
            if self._inflight is not None:
                wake_at, verdict = self._police_inflight(self._inflight, now)
            else:
                batch, wake_at = self._take_batch(now)
            if not batch and verdict is None and self._kill_reason is None:
                self._cond.wait(None if wake_at is None else max(0.0, wake_at - now))
                return True
        if verdict is not None:
            self._send(verdict)
        if batch:
            self._dispatch(batch)
        return True

    def _is_known(self, request_id: str) -> bool:
        queued = any(t.request.request_id == request_id for t in self._queue)
        return queued or bool(self._inflight and request_id in self._inflight.tickets)

    def _expire_queued(self, now: float) -> None:
        for ticket in [t for t in self._queue if t.future.done() or t.expired(now)]:
            self._queue.remove(ticket)
            if not ticket.future.cancelled():
                ticket.stop_reason = StopReason.DEADLINE
                ticket.fail(ticket.expired_in_queue_error())

    def _take_batch(self, now: float) -> tuple[list[Ticket], float | None]:
        max_outputs = self._batch_cap()
        planned = plan_batch(self._queue, max_outputs)
        deadlines = [t.deadline_at for t in self._queue if t.deadline_at is not None]
        next_deadline = min(deadlines) if deadlines else None
        if not planned:
            return [], next_deadline
        wait_s = window_remaining(planned, max_outputs, self.config.batch_window_s, now)
        if wait_s > 0:
            return [], min(now + wait_s, next_deadline or float("inf"))
        for ticket in planned:
            self._queue.remove(ticket)
        return planned, None

    def _batch_cap(self) -> int:
        """Outputs the next batch may hold: `max_batch`, within its pipeline's memory budget."""
        # Requests that each fit the declared budget (pixels × frames × outputs) must not add up
        # to a forward that does not; a first request over it still runs, alone.
        if not self._queue:
            return self.config.max_batch
        oldest = self._queue[0].request  # plan_batch builds the batch around it
        budget = self._limits.get(oldest.pipeline, {}).get("max_pixels_frames_outputs")
        if budget is None:
            return self.config.max_batch
        per_output = oldest.width * oldest.height * oldest.num_frames
        return max(1, min(self.config.max_batch, budget // max(1, per_output)))

    def _dispatch(self, planned: list[Ticket]) -> None:
        batch = []
        for ticket in planned:
            if ticket.wants_stop():
                ticket.stop_reason = StopReason.STOPPED
                ticket.fail(JobStopped(f"request {ticket.request.request_id} stopped while queued"))
            elif ticket.future.set_running_or_notify_cancel():
                batch.append(ticket)
        if not batch:
            return
        with self._cond:
            self._batch_seq += 1
            inflight = InflightBatch(
                self._batch_seq, {t.request.request_id: t for t in batch}, time.monotonic()
            )
            self._inflight = inflight
            group = self._group
        self._send(RunBatch(inflight.batch_id, tuple(t.request for t in batch)), group)

    def _police_inflight(
        self, batch: InflightBatch, now: float
    ) -> tuple[float | None, StopVerdict | None]:
        """Deadlines and desyncs of the running batch: what to stop, when to look again."""
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
                wake.append(deadline + self.config.deadline_grace_s)
            else:
                wake.append(deadline)
        if batch.first_fault_at is not None:
            wake.append(batch.first_fault_at + self.config.desync_grace_s)
        verdict = StopVerdict(batch.batch_id, -1, frozenset(newly)) if newly else None
        if wake and min(wake) <= now:
            # The next turn of the loop kills the group and fails the batch (see _rebuild).
            self._kill_reason = batch.kill_reason()
            return None, None
        return (min(wake) if wake else None), verdict

    # --- group lifecycle (dispatcher thread only) ----------------------------------------------

    def _needs_rebuild(self) -> bool:
        with self._cond:
            if self._closing:
                return False
            if self._kill_reason is not None or self._dead_reason is not None:
                return True
            return self._group is None and bool(self._queue)

    def _rebuild(self) -> None:
        with self._cond:
            old, self._group = self._group, None
            reason = self._kill_reason or self._dead_reason or "the worker group stopped"
            inflight, self._inflight = self._inflight, None
            self._kill_reason = self._dead_reason = None
        if old is not None:
            old.kill()
        if inflight is not None:
            for ticket in inflight.open_tickets():
                ticket.fail(death_error(ticket, inflight, reason))
        try:
            self._build_group()
        except GpuWorkerError as exc:
            self._fail_queued(exc)
            return
        with self._cond:
            self._rebuilds += 1

    def _build_group(self) -> None:
        with self._cond:
            self._generation += 1
            generation = self._generation
        group = WorkerGroup(
            self.config,
            on_message=lambda message: self._on_group_message(generation, message),
            on_death=lambda reason: self._group_died(generation, reason),
        )
        try:
            group.start()
        except RankStartupFailed:
            raise
        except Exception as exc:
            raise RankStartupFailed(f"starting the worker group failed: {exc}") from exc
        with self._cond:
            self._group = group
            self._limits = dict(group.limits)

    def _fail_queued(self, error: BaseException) -> None:
        with self._cond:
            queued = list(self._queue)
            self._queue.clear()
        for ticket in queued:
            ticket.fail(error)

    def _teardown(self) -> None:
        with self._cond:
            group, self._group = self._group, None
            inflight, self._inflight = self._inflight, None
        closed = WorkerGroupDied("the coordinator was shut down")
        self._fail_queued(closed)
        if inflight is not None:
            for ticket in inflight.open_tickets():
                ticket.fail(closed)
        if group is not None:
            group.shutdown()
