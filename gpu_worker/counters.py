"""Cumulative counters of a coordinator's work, for the node's metrics (`Coordinator.counters`).

They only grow (a gauge-like `peak_memory_mb` aside) and are kept under the coordinator's lock;
the node reads a copy at scrape time, so nothing here costs more than a few additions per batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

# Why a group was replaced (labels of the node's rebuild counter): a rank died or rank 0 could not
# be reached; the coordinator killed it (a deadline or a desync outlived its grace); or no group
# was running after a failed start and a request was waiting.
REBUILD_DIED = "rank_died"
REBUILD_KILLED = "killed"
REBUILD_START_FAILED = "start_failed"


@dataclass
class GroupCounters:
    """What the groups of one coordinator did since it started."""

    busy_s: float = 0.0  # wall time a batch was on the group
    steps: dict[str, int] = field(default_factory=dict)  # per pipeline: steps x outputs
    batch_sizes: dict[int, int] = field(default_factory=dict)  # outputs per forward -> forwards
    peak_memory_mb: float | None = None  # of the last forward that finished (max over ranks)
    rebuilds: dict[str, int] = field(default_factory=dict)  # per REBUILD_* reason
    # The ledger (kiln/common/ledger.py): GPU-seconds its batches occupied (each batch's wall time
    # × the group's devices, charged to its requests), and those it held warm: devices × the time
    # since its first group was ready (`warm_at`, monotonic; a snapshot fills `held_gpu_s`).
    # held - busy is its idle GPU-seconds; a group being rebuilt is held, not busy.
    devices: int = 1
    busy_gpu_s: float = 0.0
    held_gpu_s: float = 0.0
    warm_at: float | None = None

    @property
    def idle_gpu_s(self) -> float:
        """GPU-seconds held warm with no batch on the group."""
        return max(0.0, self.held_gpu_s - self.busy_gpu_s)

    def add_forward(self, pipeline: str, steps_run: int, batch_size: int, peak_mb: float) -> None:
        """Count one finished forward of `batch_size` outputs."""
        if batch_size < 1:  # every request was refused before the forward: nothing ran
            return
        self.steps[pipeline] = self.steps.get(pipeline, 0) + steps_run * batch_size
        self.batch_sizes[batch_size] = self.batch_sizes.get(batch_size, 0) + 1
        self.peak_memory_mb = peak_mb

    def add_rebuild(self, reason: str) -> None:
        """Count one replaced group."""
        self.rebuilds[reason] = self.rebuilds.get(reason, 0) + 1

    @classmethod
    def merged(cls, parts: list[GroupCounters]) -> GroupCounters:
        """Several groups' counters added up (a node of replica groups); peak: the highest."""
        total = cls(devices=sum(part.devices for part in parts) or 1)
        for part in parts:
            total.busy_s += part.busy_s
            total.busy_gpu_s += part.busy_gpu_s
            total.held_gpu_s += part.held_gpu_s
            for pipeline, steps in part.steps.items():
                total.steps[pipeline] = total.steps.get(pipeline, 0) + steps
            for size, count in part.batch_sizes.items():
                total.batch_sizes[size] = total.batch_sizes.get(size, 0) + count
            for reason, count in part.rebuilds.items():
                total.rebuilds[reason] = total.rebuilds.get(reason, 0) + count
        peaks = [part.peak_memory_mb for part in parts if part.peak_memory_mb is not None]
        total.peak_memory_mb = max(peaks) if peaks else None
        return total

    def snapshot(self) -> GroupCounters:
        """A copy that later updates do not change; `held_gpu_s` as of now."""
        held = 0.0 if self.warm_at is None else self.devices * (time.monotonic() - self.warm_at)
        return replace(
            self,
            held_gpu_s=held,
            steps=dict(self.steps),
            batch_sizes=dict(self.batch_sizes),
            rebuilds=dict(self.rebuilds),
        )
