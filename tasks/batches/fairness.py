"""How much each batch may feed in one pass: a window sized from the live nodes, shared fairly.

The window is what the live nodes serving a batch's pipeline can work through: their replica
groups × max batch (outputs in one forward) × `batch_window_factor`, plus what they finish before
the feeder comes round again (`pace`), within `batch_window_min` and `batch_window` (with no node
up: the floor). Jobs are consumed from a lane's queue in order, so a fair share of the feed is a
fair share of the queue: each API key's batches together hold at most one window of jobs queued
or running, split evenly between them, and a pass visits the keys round-robin (then each key's
batches round-robin), one key further on each pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kiln.storage.batch_records import FedBatch
from kiln.storage.states import JobState
from kiln.tasks.contract.settings import KilnSettings

# `kiln worker --max-batch`'s default, for a heartbeat that does not announce its max batch
DEFAULT_MAX_BATCH = 4


def node_capacity(node: Mapping[str, Any]) -> int:
    """Outputs one node computes at once: its replica groups × its max batch."""
    devices = len(node.get("devices") or []) or 1
    group_size = max(1, int(node.get("group_size") or devices))
    groups = max(1, devices // group_size)
    return groups * max(1, int(node.get("max_batch") or DEFAULT_MAX_BATCH))


def window_size(
    nodes: Iterable[Mapping[str, Any]],
    pipeline: str | None,
    settings: KilnSettings,
    refill_jobs: int = 0,
) -> int:
    """The feeding window for a batch of `pipeline` (None: any) from the live nodes' heartbeats.

    `refill_jobs`: what the nodes finish before the feeder comes round again (`pace`), on top.
    """
    capacity = sum(
        node_capacity(node)
        for node in nodes
        if pipeline is None or pipeline in (node.get("pipelines") or [])
    )
    sized = math.ceil(capacity * settings.batch_window_factor) + refill_jobs
    floor = min(settings.batch_window_min, settings.batch_window)
    return max(floor, min(settings.batch_window, sized))


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
