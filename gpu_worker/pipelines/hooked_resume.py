"""Step checkpoints of a pipeline that says its own state: the `save_state`/`restore_state` hooks.

Kiln does not know the loop of a `python:` pipeline, so the pipeline says what its state is
(`StepStateHooks`, gpu_worker/pipelines/base.py); everything else is Kiln's, as for a diffusers
loop (ranks/checkpoints.py): the cadence, the identity a checkpoint must match to be resumed,
the encoding (step_checkpoint.py, the state under `loop`), the writing under the attempt's lease.

- capture (rank 0): the run's `on_step_end` is wrapped (`CapturingStep`). After a step at which
  a checkpoint is due, it calls `save_state(step, total)` first, copies what it returns to the
  CPU and hands it on, then calls the node's own callback, which may stop the run: a stop always
  comes after its step's checkpoint. A state that cannot be saved (a value of another kind, a
  hook that raises) is logged and skipped: a checkpoint never fails the job.
- resume (every rank): before `run`, `restore_state` gets the checkpoint's state; the run then
  goes on after its step. A hook that raises refuses the state: the run starts from step 0 and
  the refusal is reported with the others (`RunMetrics.checkpoint_refusals`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import numpy as np
import torch

from kiln.gpu_worker.pipelines.base import (
    LatentsObserver,
    Pipeline,
    StepCallback,
    StepStateHooks,
)
from kiln.gpu_worker.pipelines.diffusers_resume import (
    Checkpointing,
    request_digest,
    weights_fingerprint,
)
from kiln.gpu_worker.pipelines.step_checkpoint import DenoiseState, cpu_state
from kiln.gpu_worker.protocol import GenerationRequest

log = logging.getLogger(__name__)


def hooks_refusal(requests: Sequence[GenerationRequest]) -> str | None:
    """Why a run of `requests` cannot take step checkpoints through the hooks; None when it can."""
    if len(requests) != 1:
        return f"a batch of {len(requests)} requests (a checkpoint is one job's)"
    return None


def hooks_identity(pipeline: Pipeline, request: GenerationRequest) -> dict[str, str]:
    """What a checkpoint of `request` must have been made by to be resumed on `pipeline`.

    The pipeline's class, the weights of its denoiser (`weights_fingerprint`; none: "none"), its
    dtype, its `state_version` (a string the author changes when the saved state's layout
    changes; absent: ""), the LoRA set, the speed mode and the request's computing fields.
    """
    denoiser = pipeline.denoiser()
    weight = next(denoiser.parameters(), None) if denoiser is not None else None
    kind = type(pipeline)
    return {
        "pipeline": pipeline.name,
        "pipeline_class": f"{kind.__module__}.{kind.__qualname__}",
        "weights": weights_fingerprint({"denoiser": denoiser}) if denoiser is not None else "none",
        "dtype": str(weight.dtype) if weight is not None else "none",
        "state_version": str(getattr(pipeline, "state_version", "")),
        "loras": json.dumps([[lora.name, lora.scale] for lora in request.loras]),
        "speed": request.speed,
        "request": request_digest(request),
    }


class CapturingStep:
    """`on_step_end` for a run that takes checkpoints: the due step's state first, then `inner`."""

    def __init__(
        self,
        inner: StepCallback,
        pipeline: StepStateHooks,
        checkpointing: Checkpointing,
        identity: dict[str, str],
    ) -> None:
        self._inner = inner
        self._pipeline = pipeline
        self._checkpointing = checkpointing
        self._identity = identity

    def __call__(self, step: int, total: int) -> None:
        """After step `step`: its checkpoint when one is due, then the node's callback."""
        # the last step's state is the output itself: nothing left to resume
        if step < total and self._checkpointing.due(step, total):
            self._capture(step, total)
        self._inner(step, total)

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Pass the latents on to the node's callback when it looks at them (previews)."""
        if isinstance(self._inner, LatentsObserver):
            self._inner.observe_latents(step, total, latents)

    def _capture(self, step: int, total: int) -> None:
        sink = self._checkpointing.sink
        assert sink is not None
        try:
            loop = cpu_state(self._pipeline.save_state(step, total), "save_state()")
        except Exception as exc:  # the pipeline's own code: its failure costs this checkpoint
            log.warning("no step checkpoint after step %d: %s: %s", step, type(exc).__name__, exc)
            return
        if not isinstance(loop, dict):
            log.warning("no step checkpoint after step %d: save_state() gave no mapping", step)
            return
        sink(DenoiseState(self._identity, step, total, latents=torch.empty(0), loop=loop))


def run_with_hooks(
    pipeline: Pipeline,
    requests: Sequence[GenerationRequest],
    on_step_end: StepCallback,
    checkpointing: Checkpointing,
    identity: dict[str, str],
) -> list[list[np.ndarray]]:
    """`pipeline.run` resumed from `checkpointing.resume` and capturing what it says is due."""
    assert isinstance(pipeline, StepStateHooks)
    resume = checkpointing.resume
    if resume is not None:
        try:
            pipeline.restore_state(resume.loop, resume.steps_done, resume.total_steps)
        except Exception as exc:
            checkpointing.refusal = (
                f"restore_state refused the state after step {resume.steps_done}: "
                f"{type(exc).__name__}: {exc}"
            )
            log.warning("request %s: %s", requests[0].request_id, checkpointing.refusal)
        else:
            checkpointing.resumed_at = resume.steps_done
    step_end = on_step_end
    if checkpointing.sink is not None:
        step_end = CapturingStep(on_step_end, pipeline, checkpointing, identity)
    return pipeline.run(requests, step_end)
