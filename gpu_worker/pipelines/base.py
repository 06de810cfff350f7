"""The pipeline contract every rank drives.

A pipeline is loaded once per rank and stays resident. `run` takes a batch of compatible
requests (equal `GenerationRequest.batch_key()`) and calls `on_step_end(step, total)` after every
denoising step; that callback may raise `StopDenoising`, which must abort the forward at once on
this rank (the rank loop makes the same decision on every rank, so the collective stays in step).

Optionally, `limits() -> kiln.common.limits.DeclaredLimits` declares the sizes, steps, frame counts
and memory budget the pipeline takes; the node announces them and requests over them are refused
before they reach a rank. It is not part of the protocol, so existing pipelines stay valid.

Previews, also optional: `preview_decoder()` names a `PreviewDecoder` for the pipeline's latents,
and `run` hands its latents after each step to `report_latents(on_step_end, ...)` (a pipeline
with a diffusers `pipe.vae` gets both from Kiln). A pipeline with neither advertises no previews.

Step checkpoints, also optional (`StepStateHooks`): a pipeline with `save_state` and
`restore_state` takes them (gpu_worker/pipelines/hooked_resume.py): Kiln saves what `save_state`
returns at the steps a checkpoint is due, and before a later attempt's `run` hands it back to
`restore_state`, whose next `run` goes on from there (docs/pipelines.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from kiln.gpu_worker.pipeline_specs import PIPELINE_MEMBERS
from kiln.gpu_worker.protocol import GenerationRequest

StepCallback = Callable[[int, int], None]


class StopDenoising(Exception):
    """Raised from a step callback to abort the current forward on this rank."""


# Latents (1, C, h, w) as `run` holds them → RGB (1, 3, H, W) in [-1, 1], on any device: what a
# pipeline's `preview_decoder()` returns (a tiny VAE, a linear map, or the identity for a
# pipeline whose "latents" are already pixels).
PreviewDecoder = Callable[[torch.Tensor], torch.Tensor]


@runtime_checkable
class LatentsObserver(Protocol):
    """A step callback that also looks at the latents after each step (rank 0's previews)."""

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Called after step `step` (from 1) with the batch's latents, before the step is done."""
        ...


def report_latents(on_step_end: StepCallback, step: int, total: int, latents: torch.Tensor) -> None:
    """Hand the batch's latents after `step` to the previews; nothing when no request wants one.

    `latents`: one row per output of the batch, in request order ((B, C, h, w); a video's
    (B, C, F, h, w)). Call it before `on_step_end(step, total)`, on every rank (only rank 0's
    callback looks).
    """
    if isinstance(on_step_end, LatentsObserver):
        on_step_end.observe_latents(step, total, latents)


@runtime_checkable
class Pipeline(Protocol):
    """A loaded generation model on one device."""

    name: str

    def supported_fields(self) -> frozenset[str]:
        """Names of the `GenerationRequest` fields this pipeline honours (e.g. `num_frames`)."""
        ...

    def validate(self, request: GenerationRequest) -> None:
        """Raise `UnsupportedRequest` naming the field when the request cannot be served."""
        ...

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        """Generate: per request, per output, a uint8 array (frames, height, width, 3)."""
        ...

    def denoiser(self) -> torch.nn.Module | None:
        """The module called once per step (unet or transformer), for parallel wrappers."""
        ...


@runtime_checkable
class StepStateHooks(Protocol):
    """A pipeline's save/restore hooks: its runs take step checkpoints and resume from them.

    Kiln runs a request that takes checkpoints alone (a batch of one). Both hooks are called on
    the rank's own thread, between steps, never during one.
    """

    def save_state(self, step: int, total: int) -> Mapping[str, Any]:
        """The loop's whole state after `step` of `total` (called from within `on_step_end`).

        Everything the steps after `step` read: latents, a scheduler's history, every random
        generator's `get_state()`; tensors (any device), numbers, strings, lists and str-keyed
        dicts of them. Kiln copies it to the CPU before the next step runs.
        """
        ...

    def restore_state(self, state: Mapping[str, Any], step: int, total: int) -> None:
        """Make the next `run` go on after `step` from `state` (what `save_state` returned).

        Called right before that `run`, on every rank, with tensors on the CPU. That `run`
        calls `on_step_end` from `step + 1`; its outputs must be those of a run never stopped.
        Raise (any exception) to refuse the state: Kiln logs why and runs from step 0.
        """
        ...


PipelineFactory = Callable[[torch.device], Pipeline]


def missing_members(candidate: object) -> list[str]:
    """The `Pipeline` members `candidate` lacks (methods must be callable)."""
    return [
        member
        for member in PIPELINE_MEMBERS
        if not hasattr(candidate, member)
        or (member != "name" and not callable(getattr(candidate, member)))
    ]
