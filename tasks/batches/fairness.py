"""How much each batch may feed in one pass: a window sized from the live nodes, shared fairly.

The window is what the live nodes serving a batch's pipeline can work through: their replica
groups × max batch (outputs in one forward) × `batch_window_factor`, plus what they finish before
the feeder comes round again (`Pace`), within `batch_window_min` and `batch_window` (with no node
up: the floor). Jobs are consumed from a lane's queue in order, so a fair share of the feed is a
fair share of the queue: each API key's batches together hold at most one window of jobs queued
or running, split evenly between them, and a pass visits the keys round-robin (then each key's
batches round-robin), one key further on each pass.

The refill (`Pace`): how many jobs each pipeline's batches finish per feeder pass, since the window
must outlast a pass. The feeder refills on a timer (every `batch_feed_interval_s`, plus the pass
itself). A window sized only from the nodes' capacity runs dry between two passes when forwards are
short: a node takes up to twice its capacity of messages at once (its Celery threads; their jobs
count as running), so only the rest of the window waits in the queue, and short forwards work
through it long before the next pass comes (measured: 20 ms per request, 0.5 s passes, the queue
empty 70 % of the time).

So each pass measures, from the batches' own counters, how fast each pipeline's batch jobs finish
(smoothed over `SMOOTHING_S`) and how long a pass takes to come round, and the window grows by
what finishes in `REFILL_PASSES` passes. Starved nodes finish only what the window lets through,
but each pass then widens it by twice that, so it grows until the nodes are the limit;
`batch_window` still caps it (Redis holds the window, not the batch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kiln.common.defaults import MAX_BATCH
from kiln.common.states import TERMINAL_STATES, JobState
from kiln.storage.batch_records import FedBatch
from kiln.tasks.contract.settings import KilnSettings

# the window holds what finishes in this many passes: one may come late (a slow pass, a busy CPU)
REFILL_PASSES = 2
# rates and the pass period are smoothed over about this many seconds
SMOOTHING_S = 1.0
ANY_PIPELINE = ""  # `capacities`' key for every live node, whatever it serves


def node_capacity(node: Mapping[str, Any]) -> int:
    """Outputs one node computes at once: its replica groups × its max batch."""
    devices = len(node.get("devices") or []) or 1
    group_size = max(1, int(node.get("group_size") or devices))
    groups = max(1, devices // group_size)
    # a heartbeat that does not announce its max batch counts `kiln worker --max-batch`'s default
    return groups * max(1, int(node.get("max_batch") or MAX_BATCH))


def capacities(nodes: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Outputs the live nodes compute at once: per pipeline they serve, and in all (key "")."""
    found: dict[str, int] = {ANY_PIPELINE: 0}
    for node in nodes:
        capacity = node_capacity(node)
        found[ANY_PIPELINE] += capacity
        for pipeline in node.get("pipelines") or []:
            found[str(pipeline)] = found.get(str(pipeline), 0) + capacity
    return found


def window_size(
    capacity: Mapping[str, int],
    pipeline: str | None,
    settings: KilnSettings,
    refill_jobs: int = 0,
) -> int:
    """The feeding window for a batch of `pipeline` (None: any) from the nodes' `capacities`.

    `refill_jobs`: what the nodes finish before the feeder comes round again (`Pace`), on top.
    """
    serving = capacity.get(ANY_PIPELINE if pipeline is None else pipeline, 0)
    sized = math.ceil(serving * settings.batch_window_factor) + refill_jobs
    floor = min(settings.batch_window_min, settings.batch_window)
    return max(floor, min(settings.batch_window, sized))


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


def in_flight(batch: FedBatch) -> int:
    """The batch's jobs queued or running now."""
    return batch.counts[JobState.QUEUED] + batch.counts[JobState.RUNNING]


@dataclass(frozen=True)
class Visit:
    """One batch to visit in a pass and how many new jobs it may feed (0: results only)."""

    batch: FedBatch
    budget: int


def _rotated(items: list[Any], turn: int) -> list[Any]:
    start = turn % len(items) if items else 0
    return items[start:] + items[:start]


def plan_pass(batches: list[FedBatch], windows: Mapping[str, int], turn: int) -> list[Visit]:
    """The visits of one pass: keys round-robin, each key's window split between its batches.

    `windows` maps each batch id to its window. A key's batches together keep at most the window
    (the largest of theirs) queued or running, and each batch at most an even share of it.
    """
    by_key: dict[str, list[FedBatch]] = {}
    for batch in batches:
        by_key.setdefault(batch.owner or "", []).append(batch)
    keyed = [by_key[key] for key in _rotated(sorted(by_key), turn)]
    budgets = {
        b.id: budget
        for group in keyed
        for b, budget in _key_budgets(_rotated(group, turn), windows)
    }
    visits: list[Visit] = []
    for rank in range(max((len(group) for group in keyed), default=0)):
        for group in keyed:
            ordered = _rotated(group, turn)
            if rank < len(ordered):
                visits.append(Visit(ordered[rank], budgets[ordered[rank].id]))
    return visits


def _key_budgets(group: list[FedBatch], windows: Mapping[str, int]) -> list[tuple[FedBatch, int]]:
    """Per batch of one key: what it may feed now within its share and the key's room left."""
    feeding = {b.id for b in group if b.status == "running" and b.stop is None}
    window = max((windows[b.id] for b in group if b.id in feeding), default=0)
    share = math.ceil(window / len(feeding)) if feeding else 0
    room = window - sum(in_flight(b) for b in group)
    budgets: list[tuple[FedBatch, int]] = []
    for batch in group:
        budget = 0
        if batch.id in feeding and room > 0:
            budget = max(0, min(share - in_flight(batch), room, batch.unfed))
            room -= budget
        budgets.append((batch, budget))
    return budgets
