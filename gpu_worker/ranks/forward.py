"""One forward on one rank, alike on every rank: stop decisions, failure classes, the outcome.

Rank 0 decides after every step whether each request of the batch stops (`StopDecision`, see
`ranks.leader.LeaderLink.decide_stops`), and broadcasts that one decision; every rank raises
`StopDenoising` on the same step, so no rank is ever left alone inside a collective.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import numpy as np
import torch
import torch.distributed as dist

from kiln.gpu_worker.logs import forward_fields
from kiln.gpu_worker.memory import PeakMemory
from kiln.gpu_worker.pipelines.base import Pipeline, StopDenoising
from kiln.gpu_worker.pipelines.diffusers_resume import ResumedLoop
from kiln.gpu_worker.pipelines.hooked_resume import run_with_hooks
from kiln.gpu_worker.pipelines.lora import adapter_state
from kiln.gpu_worker.protocol import (
    AdapterState,
    FailureKind,
    RankFault,
    RankOutcome,
    RunBatch,
    SpeedReport,
)
from kiln.gpu_worker.ranks.checkpoints import (
    CheckpointFirst,
    CheckpointSend,
    ForwardCheckpoints,
    forward_checkpoints,
)
from kiln.gpu_worker.ranks.process import send_quietly
from kiln.gpu_worker.ranks.start import RankRuntime
from kiln.gpu_worker.speed import speed_report

logger = logging.getLogger(__name__)

# Rank 0 only: (step, total) -> ids of the requests to stop at the end of this step.
StopDecision = Callable[[int, int], frozenset[str]]


class StepSync:
    """The `on_step_end` callback of a forward: one stop decision, taken by rank 0, for all."""

    def __init__(
        self, batch: RunBatch, control_group: dist.ProcessGroup | None, decide: StopDecision | None
    ) -> None:
        self._batch = batch
        self._group = control_group
        self._decide = decide  # None on the ranks that take rank 0's decision
        self._ids = [request.request_id for request in batch.requests]
        self.steps_run = 0
        self.stopped: frozenset[str] = frozenset()

    def __call__(self, step: int, total: int) -> None:
        """Take the stop decision for `step`; raises StopDenoising once every request stopped."""
        self.steps_run += 1
        flags = torch.zeros(len(self._ids), dtype=torch.uint8)
        if self._decide is not None:
            stop = self._decide(step, total)
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
    adapters: AdapterState | None = None  # the pipeline's adapter cache after the forward
    speed: SpeedReport | None = None  # how the forward ran its speed mode (gpu_worker/speed.py)
    resumed_at_step: int = 0  # the checkpoint's step it resumed from (ranks/checkpoints.py)
    checkpoint_refusals: tuple[str, ...] = ()


def forward_batch(
    runtime: RankRuntime,
    batch: RunBatch,
    sync: StepSync,
    status: Connection,
    send_checkpoint: CheckpointSend | None = None,
    checkpoint_first: CheckpointFirst | None = None,
) -> ForwardResult:
    """Run the batch on this rank; a failure here is also told to the group's owner at once.

    `send_checkpoint` (rank 0's) takes the step checkpoints this rank captures;
    `checkpoint_first` (rank 0's) names the requests stopping after a step that checkpoint it.
    """
    pipeline = runtime.pipelines[batch.requests[0].pipeline]
    level = logging.INFO if runtime.args.rank == 0 else logging.DEBUG  # one line per forward
    with forward_fields(batch.batch_id, [request.request_id for request in batch.requests]):
        logger.log(
            level,
            "forward %d: %d request(s) on %s",
            batch.batch_id,
            len(batch.requests),
            batch.requests[0].pipeline,
        )
        checkpoints = forward_checkpoints(pipeline, batch, send_checkpoint, checkpoint_first)
        result = run_forward(pipeline, batch, sync, runtime.args.rank, runtime.device, checkpoints)
        result = replace(result, adapters=adapter_state(pipeline))
        outcome = result.outcome
        logger.log(
            level,
            "forward %d %s after %d step(s) in %.2f s",
            batch.batch_id,
            outcome.status,
            outcome.steps_run,
            result.run_s,
            # the same facts as fields of a JSON line, for a log query to read without parsing
            extra={"steps": outcome.steps_run, "run_s": round(result.run_s, 4)},
        )
        if outcome.kind is not None:
            # Tell the owner at once: if the other ranks did not fail alike, rank 0 may never
            # get to report, and the coordinator would otherwise only learn of it from a timeout.
            notice = RankFault(outcome.rank, batch.batch_id, outcome.kind, outcome.message, False)
            send_quietly(status, notice)
    return result


def run_forward(
    pipeline: Pipeline,
    batch: RunBatch,
    sync: StepSync,
    rank: int,
    device: torch.device,
    checkpoints: ForwardCheckpoints | None = None,
) -> ForwardResult:
    """Run the batch through the pipeline; never raises for the pipeline's own failures."""
    memory = PeakMemory(device)
    memory.reset()
    started = time.monotonic()
    outputs: list[list[np.ndarray]] | None = None
    status, kind, message = "ok", None, ""
    try:
        if checkpoints is None:
            outputs = pipeline.run(batch.requests, sync)
        elif isinstance(pipeline, ResumedLoop):
            outputs = pipeline.run(batch.requests, sync, checkpointing=checkpoints.checkpointing)
        else:  # a pipeline with save/restore hooks (forward_checkpoints checked)
            outputs = run_with_hooks(
                pipeline, batch.requests, sync, checkpoints.checkpointing, checkpoints.identity
            )
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
    speed = speed_report(pipeline) if status == "ok" else None
    if checkpoints is None:
        return ForwardResult(outcome, outputs, run_s, speed=speed)
    return ForwardResult(
        outcome,
        outputs,
        run_s,
        speed=speed,
        resumed_at_step=checkpoints.checkpointing.resumed_at,
        checkpoint_refusals=checkpoints.all_refusals(),
    )


def _check_shape(outputs: list[list[np.ndarray]], requests: Sequence[object]) -> None:
    if len(outputs) != len(requests):
        raise RuntimeError(f"pipeline returned {len(outputs)} results for {len(requests)} requests")


# Transport failures of a collective that torch raises as a plain RuntimeError, not a DistError:
# gloo's ("[.../gloo/transport/tcp/pair.cc:537] Read error [...]: Connection reset by peer" when a
# peer rank died under a broadcast) and NCCL's. Each means the group is broken, not the pipeline.
_COLLECTIVE_MARKERS = ("gloo/transport/", "ProcessGroupGloo", "ProcessGroupNCCL", "NCCL error")


def classify_failure(exc: BaseException) -> FailureKind:
    """OOM, a broken collective (the group must go), or any other pipeline error."""
    if isinstance(exc, torch.OutOfMemoryError):
        return FailureKind.OOM
    if isinstance(exc, dist.DistError):
        return FailureKind.COLLECTIVE
    if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COLLECTIVE_MARKERS):
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
