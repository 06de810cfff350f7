"""What every event stream (SSE) of the API shares: its slot, and what ends it early.

Streams hold slots (`StreamSlots`: per key, in total, shared fairly) and end early when their
lifetime is over, their slot is given to a key under its fair share, or their key is revoked
(`StreamGuard`); the client then resumes where it was. The streams themselves are their routes':
a job's in `event_routes`, a batch's in `batch_event_routes`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import anyio
import anyio.to_thread

from kiln.tasks.api.auth import Authenticator, AuthError

log = logging.getLogger(__name__)


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
