"""A forward's step checkpoints on the ranks: which state it resumes from, and who takes them.

Every rank runs the same denoising loop (each parallel mode divides work inside the denoiser and
gathers it back, so the loop's latents, scheduler and generators are alike on every rank), so:

- resume: every rank decodes the request's offered checkpoints (`CheckpointPlan.resume`, newest
  first) against its own pipeline identity and resumes from the first valid one. The bytes and
  the pipeline are the same on every rank, so every rank takes the same decision and the ranks
  stay in step; one passed over is logged with its reason and reported in `RunMetrics`.
- capture: rank 0 alone takes a checkpoint when the cadence says so, encodes it, and sends it
  to the coordinator (`StepCheckpoint`); the node writes it. The other ranks capture nothing.

Two kinds of pipeline take part: a `ResumedLoop` (DiffusersPipeline), for the loops it resumes,
and one with the save/restore hooks (`StepStateHooks`: pipelines/hooked_resume.py); for any other
the request runs from step 0, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.gpu_worker.pipelines.base import Pipeline, StepStateHooks
from kiln.gpu_worker.pipelines.diffusers_resume import Checkpointing, ResumedLoop
from kiln.gpu_worker.pipelines.hooked_resume import hooks_identity, hooks_refusal
from kiln.gpu_worker.pipelines.step_checkpoint import (
    CheckpointRefused,
    DenoiseState,
    decode,
    encode,
)
from kiln.gpu_worker.protocol import CheckpointPlan, RunBatch, StepCheckpoint

logger = logging.getLogger(__name__)

# rank 0's way to the coordinator (LeaderLink.send)
CheckpointSend = Callable[[StepCheckpoint], None]
# rank 0's: the requests that stop after this step and checkpoint it first, whatever the cadence
# (LeaderLink.checkpoint_first: a drain hands them back to resume elsewhere)
CheckpointFirst = Callable[[int], frozenset[str]]


@dataclass
class ForwardCheckpoints:
    """One forward's checkpointing, and what the offered checkpoints came to."""

    checkpointing: Checkpointing
    identity: dict[str, str]  # what made the checkpoints it resumes from and takes
    refusals: list[str] = field(default_factory=list)

    def all_refusals(self) -> tuple[str, ...]:
        """The offered checkpoints passed over, then a refusal inside the call (if any)."""
        inside = self.checkpointing.refusal
        return (*self.refusals, *([inside] if inside else []))


def cadence(plan: CheckpointPlan) -> Callable[[int, int], bool]:
    """`due(steps_done, total)`: whether a checkpoint is due after that step.

    After each multiple of `every_steps` (the same steps wherever the run resumed), or once
    `every_seconds` have passed since the last one taken (or since the run began).
    """
    last_at = [time.monotonic()]

    def due(done: int, _total: int) -> bool:
        now = time.monotonic()
        by_steps = plan.every_steps is not None and done % plan.every_steps == 0
        by_time = plan.every_seconds is not None and now - last_at[0] >= plan.every_seconds
        if by_steps or by_time:
            last_at[0] = now
            return True
        return False

    return due


def _due(
    plan: CheckpointPlan, request_id: str, checkpoint_first: CheckpointFirst | None
) -> Callable[[int, int], bool]:
    """The plan's cadence, or the request stopping after this step to resume elsewhere."""
    by_cadence = cadence(plan)

    def due(done: int, total: int) -> bool:
        stopping = checkpoint_first is not None and request_id in checkpoint_first(done)
        return by_cadence(done, total) or stopping

    return due


def forward_checkpoints(
    pipeline: Pipeline,
    batch: RunBatch,
    send: CheckpointSend | None,
    checkpoint_first: CheckpointFirst | None = None,
) -> ForwardCheckpoints | None:
    """The batch's checkpointing on this rank (`send` on rank 0 only); None: it has none.

    Rank 0 captures when the plan's cadence says so, and at the step the request stops at when
    `checkpoint_first` names it (a drain): it goes back to the queue having lost no step.
    """
    request = batch.requests[0]
    plan = request.checkpoint
    if plan is None:
        return None
    if isinstance(pipeline, ResumedLoop):
        refusal = pipeline.checkpoint_refusal(batch.requests)
    elif isinstance(pipeline, StepStateHooks):
        refusal = hooks_refusal(batch.requests)
    else:
        logger.info("request %s: %s takes no step checkpoints", request.request_id, pipeline.name)
        return None
    if refusal is not None:
        logger.info("request %s: no step checkpoints: %s", request.request_id, refusal)
        return None
    if isinstance(pipeline, ResumedLoop):
        identity = pipeline.checkpoint_identity(request)
    else:
        identity = hooks_identity(pipeline, request)
    checkpointing = Checkpointing(due=_due(plan, request.request_id, checkpoint_first))
    found = ForwardCheckpoints(checkpointing, identity)
    for data in plan.resume:
        try:
            found.checkpointing.resume = decode(data, identity)
            break
        except CheckpointRefused as exc:
            found.refusals.append(str(exc))
            logger.warning("request %s: checkpoint refused: %s", request.request_id, exc)
    if send is not None:

        def sink(state: DenoiseState) -> None:
            data = encode(state)
            send(
                StepCheckpoint(
                    batch.batch_id, request.request_id, state.steps_done, state.total_steps, data
                )
            )

        found.checkpointing.sink = sink
    return found
