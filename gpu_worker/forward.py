"""One forward on one rank: the per-step stop decision, failure classification, the outcome.

Rank 0 decides after every step whether each request of the batch stops, and broadcasts that one
decision; every rank raises `StopDenoising` on the same step, so no rank is ever left alone
inside a collective. Rank 0 never waits on a user callback: it sends `StepDone(k)` and, at the
end of step k+1, takes the coordinator's `StopVerdict` for step k (waiting for it only if the
coordinator is more than a whole step behind, and then at most `verdict_wait_s`).
"""

from __future__ import annotations

import gc
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from gpu_worker.memory import PeakMemory
from gpu_worker.pipelines.base import Pipeline, StopDenoising
from gpu_worker.protocol import (
    CoordinatorCommand,
    FailureKind,
    LeaderMessage,
    RankOutcome,
    RunBatch,
    ShutdownGroup,
    StepDone,
    StopVerdict,
)


class LeaderLink:
    """Rank 0's end of the coordinator's pipes: commands and verdicts in, messages out."""

    def __init__(self, commands: Connection, results: Connection, verdict_wait_s: float) -> None:
        self._commands = commands
        self._results = results
        self._verdict_wait_s = verdict_wait_s
        self._queued: deque[RunBatch | ShutdownGroup] = deque()
        self._batch_id: int | None = None
        self._answered_step = 0
        self._stop_ids: set[str] = set()

    def next_command(self) -> RunBatch | ShutdownGroup:
        """Block (in the kernel, no polling) until the coordinator sends a batch or shutdown."""
        while not self._queued:
            self._take(self._commands.recv())
        return self._queued.popleft()

    def begin(self, batch_id: int) -> None:
        """Verdicts from now on are about this batch; earlier ones are stale."""
        self._batch_id, self._answered_step, self._stop_ids = batch_id, 0, set()

    def send(self, message: LeaderMessage) -> None:
        """Send one message to the coordinator."""
        self._results.send(message)

    def stop_ids(self, step: int) -> frozenset[str]:
        """Requests to stop at the end of `step`, once the verdict on `step - 1` is in."""
        deadline = time.monotonic() + self._verdict_wait_s
        while True:
            while self._commands.poll(0):
                self._take(self._commands.recv())
            if self._answered_step >= step - 1:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._commands.poll(remaining):
                break  # a slow callback must not stall the group: decide with what we have
        return frozenset(self._stop_ids)

    def _take(self, command: CoordinatorCommand) -> None:
        if isinstance(command, StopVerdict):
            if command.batch_id == self._batch_id:
                self._stop_ids |= command.stop_ids
                self._answered_step = max(self._answered_step, command.after_step)
        else:
            self._queued.append(command)


class StepSync:
    """The `on_step_end` callback of a forward: one stop decision, taken by rank 0, for all."""

    def __init__(
        self, batch: RunBatch, control_group: dist.ProcessGroup | None, link: LeaderLink | None
    ) -> None:
        self._batch = batch
        self._group = control_group
        self._link = link
        self._ids = [request.request_id for request in batch.requests]
        self.steps_run = 0
        self.stopped: frozenset[str] = frozenset()

    def __call__(self, step: int, total: int) -> None:
        self.steps_run += 1
        flags = torch.zeros(len(self._ids), dtype=torch.uint8)
        if self._link is not None:
            self._link.send(StepDone(self._batch.batch_id, step, total))
            stop = self._link.stop_ids(step)
            flags = torch.tensor([rid in stop for rid in self._ids], dtype=torch.uint8)
        if self._group is not None:
            dist.broadcast(flags, src=0, group=self._group)
        self.stopped = frozenset(
            rid for rid, flag in zip(self._ids, flags.tolist(), strict=True) if flag
        )
        if len(self.stopped) == len(self._ids):
            raise StopDenoising(f"batch {self._batch.batch_id} stopped after step {step}")


@dataclass(frozen=True)
class ForwardResult:
    """What one rank got out of a forward: its outcome, and outputs when it succeeded."""

    outcome: RankOutcome
    outputs: list[list[np.ndarray]] | None
    run_s: float


def run_forward(
    pipeline: Pipeline, batch: RunBatch, sync: StepSync, rank: int, device: torch.device
) -> ForwardResult:
    """Run the batch through the pipeline; never raises for the pipeline's own failures."""
    memory = PeakMemory(device)
    memory.reset()
    started = time.monotonic()
    outputs: list[list[np.ndarray]] | None = None
    status, kind, message = "ok", None, ""
    try:
        outputs = pipeline.run(batch.requests, sync)
        _check_shape(outputs, batch.requests)
    except StopDenoising:
        status = "stopped"
    except Exception as exc:
        status, kind, message = "failed", classify_failure(exc), _describe(exc)
        outputs = None
        if kind is FailureKind.OOM:
            release_cached_memory(device)
    run_s = time.monotonic() - started
    peak_mb = memory.measure().peak_mb
    outcome = RankOutcome(rank, status, kind, message, sync.steps_run, peak_mb)
    return ForwardResult(outcome, outputs, run_s)


def _check_shape(outputs: list[list[np.ndarray]], requests: Sequence[object]) -> None:
    if len(outputs) != len(requests):
        raise RuntimeError(f"pipeline returned {len(outputs)} results for {len(requests)} requests")


def classify_failure(exc: BaseException) -> FailureKind:
    """OOM, a broken collective (the group must go), or any other pipeline error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return FailureKind.OOM
    if isinstance(exc, dist.DistError):
        return FailureKind.COLLECTIVE
    if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):
        return FailureKind.OOM  # the CPU allocator's wording (DefaultCPUAllocator)
    return FailureKind.ERROR


def release_cached_memory(device: torch.device) -> None:
    """After an OOM: drop garbage and give cached blocks back so the next request fits."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _describe(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text[-8000:]  # the tail holds the raise site; keep messages small on the pipe
