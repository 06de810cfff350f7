"""How many jobs each pipeline's batches finish per feeder pass: the window must outlast a pass.

The feeder refills on a timer (every `batch_feed_interval_s`, plus the pass itself). A window sized
only from the nodes' capacity runs dry between two passes when forwards are short: a node takes up
to twice its capacity of messages at once (its Celery threads; their jobs count as running), so
only the rest of the window waits in the queue, and short forwards work through it long before
the next pass comes (measured: 20 ms per request, 0.5 s passes, the queue empty 70 % of the time).

So each pass measures, from the batches' own counters, how fast each pipeline's batch jobs finish
(smoothed over `SMOOTHING_S`) and how long a pass takes to come round, and the window grows by
what finishes in `REFILL_PASSES` passes. Starved nodes finish only what the window lets through,
but each pass then widens it by twice that, so it grows until the nodes are the limit;
`batch_window` still caps it (Redis holds the window, not the batch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kiln.storage.batch_records import FedBatch
from kiln.storage.states import TERMINAL_STATES

# the window holds what finishes in this many passes: one may come late (a slow pass, a busy CPU)
REFILL_PASSES = 2
# rates and the pass period are smoothed over about this many seconds
SMOOTHING_S = 1.0


def finished(batch: FedBatch) -> int:
    """The batch's jobs that have ended."""
    return sum(batch.counts[state] for state in TERMINAL_STATES)


@dataclass
class _Seen:
    at: float
    finished: int
    rate: float = 0.0  # jobs per second, smoothed


class Pace:
    """Each pipeline's finish rate and the feeder's pass period, updated once per pass."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.period_s = interval_s  # time between two passes, smoothed (never below the interval)
        self._last_pass: float | None = None
        self._seen: dict[str, _Seen] = {}

    def observe(self, batches: Iterable[FedBatch]) -> None:
        """Record a pass seeing `batches` now (forgets batches no longer among them)."""
        now = self.clock()
        if self._last_pass is not None and now > self._last_pass:
            period = self._smoothed(self.period_s, now - self._last_pass, now - self._last_pass)
            self.period_s = max(self.interval_s, period)
        self._last_pass = now
        seen: dict[str, _Seen] = {}
        for batch in batches:
            before = self._seen.get(batch.id)
            done = finished(batch)
            if before is None or now <= before.at:
                seen[batch.id] = before or _Seen(now, done)
                continue
            elapsed = now - before.at
            rate = max(0, done - before.finished) / elapsed
            if before.rate:  # until jobs finish, each measure stands alone: no slow ramp from 0
                rate = self._smoothed(before.rate, rate, elapsed)
            seen[batch.id] = _Seen(now, done, rate)
        self._seen = seen

    def refill_jobs(self, batches: Iterable[FedBatch], pipeline: str | None) -> int:
        """Jobs of `pipeline`'s batches (None: all) that finish in `REFILL_PASSES` passes."""
        rate = sum(
            self._seen[b.id].rate
            for b in batches
            if b.id in self._seen and (pipeline is None or b.pipeline == pipeline)
        )
        return math.ceil(rate * self.period_s * REFILL_PASSES)

    @staticmethod
    def _smoothed(old: float, new: float, elapsed: float) -> float:
        weight = 1.0 - math.exp(-elapsed / SMOOTHING_S)
        return old + weight * (new - old)
