"""Server-sent events from a job's event stream: resumable by seq, ends after the terminal event."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.to_thread

from kiln.storage.status import JobEvent, JobStore
from kiln.tasks.contract.states import is_terminal
from kiln.tasks.contract.views import event_view


def format_event(event: JobEvent) -> str:
    """One SSE frame: `id` is the event's seq, so `Last-Event-ID` resumes right after it."""
    data = json.dumps(event_view(event).model_dump(mode="json"), separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type}\ndata: {data}\n\n"


class StreamSlots:
    """Counts open event streams per API key and in total, refusing any past either cap.

    Each open stream holds a Redis connection in its blocking read; the caps keep streams below
    the connection pool, so plain requests always find a connection.
    """

    def __init__(self, per_key: int, total: int) -> None:
        self.per_key = per_key
        self.total = total
        self._open: Counter[str] = Counter()
        self._lock = threading.Lock()  # acquired in route threads, released on the event loop

    def acquire(self, key: str) -> Callable[[], None] | None:
        """A slot for `key` as its release function (idempotent), or None when at a cap."""
        with self._lock:
            if self._open[key] >= self.per_key or self._open.total() >= self.total:
                return None
            self._open[key] += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._open[key] -= 1
                    if not self._open[key]:
                        del self._open[key]

        return release


class EventStream:
    """Async iterator of SSE frames for one job; store reads run in threads under a limiter."""

    def __init__(
        self,
        store: JobStore,
        job_id: str,
        after_seq: int,
        *,
        block_ms: int,
        keepalive_s: float,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.after_seq = after_seq
        self.block_ms = block_ms
        self.keepalive_s = keepalive_s
        self.limiter = limiter

    async def _read(self, block_ms: int | None) -> list[JobEvent]:
        call = functools.partial(
            self.store.events, self.job_id, after_seq=self.after_seq, block_ms=block_ms
        )
        return await anyio.to_thread.run_sync(call, limiter=self.limiter)

    async def _finished(self) -> bool:
        record = await anyio.to_thread.run_sync(self.store.get, self.job_id, limiter=self.limiter)
        return is_terminal(record.state)

    async def frames(self) -> AsyncIterator[str]:
        """Frames until the terminal event (or at once if the job ended before `after_seq`)."""
        last_sent = time.monotonic()
        while True:
            events = await self._read(self.block_ms)
            if not events and await self._finished():
                # The terminal event is written with the state: read once more, then stop.
                events = await self._read(None)
                if not events:
                    return
            for event in events:
                self.after_seq = event.seq
                yield format_event(event)
                if is_terminal(event.type):
                    return
            if events:
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= self.keepalive_s:
                last_sent = time.monotonic()
                yield ": keep-alive\n\n"
