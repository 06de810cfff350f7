"""Server-sent events from a job's event stream: resumable by seq, ends after the terminal event.

Streams hold slots (`StreamSlots`: per key, in total, shared fairly) and end early when their
lifetime is over, their slot is given to a key under its fair share, or their key is revoked
(`StreamGuard`); the client then resumes where it was.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.to_thread
from pydantic import ValidationError

from kiln.common.states import is_terminal
from kiln.storage.job_store import JobEvent, JobStore
from kiln.tasks.api.auth import Authenticator, AuthError
from kiln.tasks.contract.events import event_json, parse_event

log = logging.getLogger(__name__)


def format_event(event: JobEvent) -> str:
    """One SSE frame: `id` is the event's seq, so `Last-Event-ID` resumes right after it.

    The data is the event parsed with the contract's union (tasks/contract/events.py) and given
    back as written. An entry the union refuses still goes out as stored, with a warning: a
    client's seqs never skip one.
    """
    try:
        wire = event_json(parse_event(event))
    except ValidationError as exc:
        log.warning("event %d of job stream is no known event, sent as stored: %s", event.seq, exc)
        wire = {"seq": event.seq, "type": event.type, "time": event.time, "payload": event.payload}
    data = json.dumps(wire, separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type}\ndata: {data}\n\n"


class OpenStream:
    """One open event stream's slot: its key, when it must end, and why it was ended (if so)."""

    def __init__(self, slots: StreamSlots, key: str, opened_at: float, lifetime_s: float) -> None:
        self.key = key
        self.opened_at = opened_at
        self.deadline = opened_at + lifetime_s
        self.ended_by: str | None = None  # "lifetime", "evicted" or "revoked" once told to end
        self._slots = slots

    def release(self) -> None:
        """Give the slot back (idempotent): the stream ended, however it ended."""
        self._slots.release(self)

    def end(self, reason: str) -> None:
        """Tell the stream to end at its next turn; its slot is free from now on."""
        if self.ended_by is None:
            self.ended_by = reason
        self.release()

    def seconds_left(self, now: float) -> float:
        """Time until the stream's lifetime is over (0 once it is)."""
        return max(0.0, self.deadline - now)


class StreamSlots:
    """Open event streams per API key and in total, shared fairly; each one ends in time.

    Each open stream holds a Redis connection in its blocking read; the caps keep streams below
    the connection pool, so plain requests always find a connection. The rule when all `total`
    slots are taken: a key's fair share is `total // k` (at least 1), k the number of keys
    holding streams, the asking one included. A key under its share gets a slot: the oldest
    stream of the key holding the most (of equals, the one holding longest) is ended for it, if
    that key is over its share. A key at
    or over its share waits (429). No key ever holds more than `per_key`, and a stream lives at
    most `lifetime_s` (its client resumes), so no key holds a slot for ever.
    """

    def __init__(
        self,
        per_key: int,
        total: int,
        lifetime_s: float = float("inf"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_key = per_key
        self.total = total
        self.lifetime_s = lifetime_s
        self._clock = clock
        self._open: dict[str, list[OpenStream]] = {}  # per key, oldest first
        self._count = 0
        self._lock = threading.Lock()  # acquired in route threads, released on the event loop

    def fair_share(self, key: str) -> int:
        """The slots `key` may hold while the total is full (keys holding streams, and it)."""
        keys = len(self._open) + (key not in self._open)
        return max(1, self.total // keys)

    def acquire(self, key: str) -> OpenStream | None:
        """A slot for `key`, or None when it is at its cap or its fair share of a full total."""
        with self._lock:
            held = self._open.get(key, [])
            if len(held) >= self.per_key:
                return None
            if self._count >= self.total:
                victim = self._victim_for(key)
                if victim is None:
                    return None
                log.info("event stream of key %s ended for key %s (fair share)", victim.key, key)
                self._drop(victim)
                victim.ended_by = "evicted"
            stream = OpenStream(self, key, self._clock(), self.lifetime_s)
            self._open.setdefault(key, []).append(stream)
            self._count += 1
        return stream

    def _victim_for(self, key: str) -> OpenStream | None:
        share = self.fair_share(key)
        if len(self._open.get(key, [])) >= share:
            return None
        largest = max(self._open, key=lambda k: len(self._open[k]))
        if len(self._open[largest]) <= share:
            return None
        return self._open[largest][0]

    def _drop(self, stream: OpenStream) -> bool:
        held = self._open.get(stream.key)
        if held is None or stream not in held:
            return False
        held.remove(stream)
        if not held:
            del self._open[stream.key]
        self._count -= 1
        return True

    def release(self, stream: OpenStream) -> None:
        """Free `stream`'s slot (no effect if it was freed already)."""
        with self._lock:
            self._drop(stream)

    def streams_of(self, key: str) -> int:
        """How many streams `key` holds now."""
        with self._lock:
            return len(self._open.get(key, []))


class StreamGuard:
    """What ends an open stream before its natural end: its lifetime, eviction, its key revoked.

    The key is checked through the API's `Authenticator` and its cache, so a revoked key's
    streams end within `KILN_API_KEY_CACHE_S` plus one blocking read (`KILN_SSE_BLOCK_MS`).
    """

    def __init__(
        self,
        stream: OpenStream,
        auth: Authenticator,
        authorization: str | None,
        limiter: anyio.CapacityLimiter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.auth = auth
        self.authorization = authorization
        self.limiter = limiter
        self._clock = clock

    async def _key_revoked(self) -> bool:
        try:
            if self.auth.cached_principal(self.authorization) is None:  # no Redis read
                await anyio.to_thread.run_sync(
                    self.auth.principal, self.authorization, limiter=self.limiter
                )
        except AuthError:
            return True
        return False

    async def ended(self) -> str | None:
        """Why the stream must end now ("lifetime", "evicted", "revoked"), or None."""
        if self.stream.ended_by is None and self.stream.seconds_left(self._clock()) <= 0:
            self.stream.end("lifetime")
        if self.stream.ended_by is None and await self._key_revoked():
            self.stream.end("revoked")
        return self.stream.ended_by

    def block_ms(self, block_ms: int) -> int:
        """A blocking read's time, cut to what is left of the stream's lifetime (at least 1)."""
        left_ms = int(self.stream.seconds_left(self._clock()) * 1000)
        return max(1, min(block_ms, left_ms))


def closing_frame(reason: str) -> str:
    """The last frame of a stream ended early: a comment (clients ignore it), then the end."""
    return f": stream closed ({reason}); reconnect to resume\n\n"


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
        guard: StreamGuard,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.after_seq = after_seq
        self.block_ms = block_ms
        self.keepalive_s = keepalive_s
        self.limiter = limiter
        self.guard = guard

    async def _read(self, block_ms: int | None) -> list[JobEvent]:
        call = functools.partial(
            self.store.events, self.job_id, after_seq=self.after_seq, block_ms=block_ms
        )
        return await anyio.to_thread.run_sync(call, limiter=self.limiter)

    async def _finished(self) -> bool:
        record = await anyio.to_thread.run_sync(self.store.get, self.job_id, limiter=self.limiter)
        return is_terminal(record.state)

    async def frames(self) -> AsyncIterator[str]:
        """Frames until the terminal event (or at once if the job ended before `after_seq`).

        A stream the guard ends stops after the last whole event it sent: the client resumes
        with `Last-Event-ID` and loses nothing.
        """
        last_sent = time.monotonic()
        while True:
            reason = await self.guard.ended()
            if reason is not None:
                yield closing_frame(reason)
                return
            events = await self._read(self.guard.block_ms(self.block_ms))
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
