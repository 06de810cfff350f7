"""Progress writes off the compute path.

The coordinator calls a job's progress callback on its own threads, between two forwards; a Redis
round trip there would idle the GPU. Callbacks only record the latest progress of each job here,
and one writer thread flushes what is pending. Stage changes and last steps wake it at once; other
steps wait for the throttle interval. Only the newest progress of a job matters, so updates that
arrive before a flush simply replace each other.

A job's previews take the same path (`preview`): the newest of each job is kept, and the writer
thread encodes it (tasks/node/previews.py) and appends its `preview` event. Unlike step progress,
the newest preview is not dropped at the job's end: `settle` writes it (and waits for one being
written), so the last preview a client sees is the last one the job made, before its end.

The stages a job's own task thread announces (encoding, uploading) and its `output` events
(`event_soon`) are each written, in order, by a second thread (`write_soon`): the round trip
overlaps the work it announces instead of delaying it, and every stage still gets its event.
`settle` waits for them before the job's terminal transition, so no stage or output event can
follow the terminal one; a call the second thread has not begun by then (the last output's event,
handed over a moment before) runs on the settling thread instead, in its order.

Every write goes through the job's `JobEvents` (tasks/webhooks/event_sink.py): the node's one sink
writes the typed payload to Redis and tells its listeners (metrics, the job's webhooks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kiln.storage.errors import StorageError
from kiln.tasks.contract.events import OutputPayload, PreviewPayload, ProgressData
from kiln.tasks.webhooks.event_sink import JobEvents

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingProgress:
    """The newest progress of one job, not yet written."""

    events: JobEvents
    progress: ProgressData


@dataclass(frozen=True)
class PendingPreview:
    """The newest preview of one job, not yet written: `payload()` encodes it, on the writer."""

    events: JobEvents
    payload: Callable[[], PreviewPayload]


class ProgressWriter:
    """Writes the newest progress of each job from one background thread."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._pending: dict[str, PendingProgress] = {}
        self._previews: dict[str, PendingPreview] = {}  # the newest per job: the rest are moot
        self._previews_writing: set[str] = set()  # jobs whose preview a flush is writing now
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # keeps one job's writes in order across threads
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-progress", daemon=True)
        # one thread: the stages handed over are written in the order they were announced
        self._ordered = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-progress-stage")
        # per job, each call handed to that thread, in order, with its future
        self._handed_over: dict[str, list[tuple[Future[None], Callable[[], None]]]] = {}

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def stop(self) -> None:
        """Flush what is pending and stop."""
        self._ordered.shutdown(wait=True)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def update(self, job_id: str, pending: PendingProgress, urgent: bool) -> None:
        """Record a job's newest progress (memory only); `urgent` wakes the writer now."""
        with self._lock:
            self._pending[job_id] = pending
        if urgent:
            self._wake.set()

    def preview(self, job_id: str, pending: PendingPreview) -> None:
        """Record a job's newest preview (memory only; it replaces an unwritten one), wake."""
        with self._lock:
            self._previews[job_id] = pending
        self._wake.set()

    def discard(self, job_id: str) -> None:
        """Forget a job's unwritten progress and preview (its terminal state supersedes them)."""
        with self._lock:
            self._pending.pop(job_id, None)
            self._previews.pop(job_id, None)

    def event_soon(self, events: JobEvents, payload: OutputPayload) -> None:
        """Append a job's `output` event next, in order with its stages (`settle` waits for it)."""

        def append() -> None:
            try:
                events.write(payload)
            except StorageError as exc:  # like progress: best effort, a stale token expected
                log.debug("%s event of %s not written: %s", payload.kind, events.job_id, exc)

        self.call_soon(events.job_id, append)

    def call_soon(self, job_id: str, call: Callable[[], None]) -> None:
        """Run `call` for a job next on the ordered thread (`settle` waits for it).

        For work a compute-path callback must not wait on (a webhook's enqueue at a job's start).
        """
        self._hand_over(job_id, call)

    def write_now(self, job_id: str, pending: PendingProgress) -> None:
        """Write a job's progress on the calling thread, superseding anything pending for it.

        For callers that are off the compute path anyway (the job's own task thread).
        """
        with self._write_lock:
            self.discard(job_id)
            self._write(job_id, pending)

    def write_soon(self, job_id: str, pending: PendingProgress) -> None:
        """Have a job's progress written next, after the stages handed over before it.

        Like `write_now` (it supersedes anything pending for the job), without the wait: for the
        job's task thread, whose next step (encode, upload) then overlaps the write.
        """
        self._hand_over(job_id, lambda: self.write_now(job_id, pending))

    def _hand_over(self, job_id: str, call: Callable[[], None]) -> None:
        """Queue `call` on the ordered thread, noted for the job's `settle`."""
        try:
            future = self._ordered.submit(call)
        except RuntimeError:  # stopped (the node is going down): run it here
            call()
            return
        with self._lock:
            self._handed_over.setdefault(job_id, []).append((future, call))

    def settle(self, job_id: str) -> None:
        """Before a job's terminal transition: its handed-over calls and newest preview written.

        Its step progress not yet written is dropped (the terminal state supersedes it).

        The calls the ordered thread has not begun are taken back (cancelled there, from the last
        one, so that thread cannot begin a later one first) and run here, in order, once the ones
        it began are done. The caller would only wait for them: typically the last output's
        event, handed over just before, which the ordered thread would take up after a wake-up
        and whose end would take another to reach the caller (each a few tenths of a
        millisecond on a busy node), on every job's way to its end.
        """
        with self._lock:
            handed_over = self._handed_over.pop(job_id, [])
        taken_back: list[Callable[[], None]] = []
        while handed_over and handed_over[-1][0].cancel():
            taken_back.insert(0, handed_over.pop()[1])
        wait([future for future, _ in handed_over])
        for call in taken_back:
            try:
                call()
            except Exception:  # as on the ordered thread: a failing call never fails the job
                log.exception("a handed-over call of %s failed", job_id)
        self._write_last_preview(job_id)
        self.discard(job_id)

    def _write_last_preview(self, job_id: str) -> None:
        """Write the job's unwritten preview here, after any of its previews being written.

        Only a job with a preview pending or being written waits (for the flush that holds the
        write lock): a job without previews passes through without touching it.
        """
        with self._lock:
            if job_id not in self._previews and job_id not in self._previews_writing:
                return
        with self._write_lock:  # a flush writing this job's older preview ends first
            with self._lock:
                pending = self._previews.pop(job_id, None)
            if pending is not None:
                self._write_preview(job_id, pending)

    def flush(self) -> None:
        """Write everything pending now (one Lua call per job)."""
        with self._write_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                previews, self._previews = self._previews, {}
                self._previews_writing = set(previews)
            try:
                for job_id, item in pending.items():
                    self._write(job_id, item)
                for job_id, preview in previews.items():
                    self._write_preview(job_id, preview)
            finally:
                with self._lock:
                    self._previews_writing = set()

    def _write_preview(self, job_id: str, item: PendingPreview) -> None:
        try:
            item.events.write(item.payload())
        except StorageError as exc:  # best effort, as progress
            log.debug("preview of %s not written: %s", job_id, exc)
        except Exception:  # an encoder's failure costs the preview, never the job
            log.exception("preview of %s could not be encoded", job_id)

    def _write(self, job_id: str, item: PendingProgress) -> None:
        try:
            item.events.write(item.progress)
        except StorageError as exc:  # progress is best effort; a stale token is expected
            log.debug("progress of %s not written: %s", job_id, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.flush()
        self.flush()
