"""Step checkpoints of a diffusers pipeline's own denoising loop: capture, and resume mid-loop.

diffusers' pipelines own their loop, so Kiln captures and restores around it, through what the
verified pipelines' `__call__` offers (`RESUMABLE_PIPELINES`):

- capture: `callback_on_step_end` hands over the latents after step i; at that moment the
  scheduler holds its state for step i + 1 and the generators theirs, so the three together are
  the run's whole state (`capture_state`).
- resume from step k: the call is made as usual (same prompt, seed, steps), and two hooks take
  over where the state would be built. The pipeline sets its timesteps, then calls
  `prepare_latents`: Kiln's stand-in checks the schedule is the checkpoint's, restores the
  generators and returns the checkpoint's latents as they were (the real one would draw noise
  and scale it by `init_noise_sigma`). The loop then asks `if self.interrupt: continue` at the
  top of each step: the first k answers are "skip" (no denoiser call, no scheduler step), and
  the (k+1)-th restores the scheduler's state and lets step k + 1 run. From there the loop runs
  exactly the operations the uninterrupted run would have: the outputs are byte-identical on the
  same device and dtype (tests/gpu_worker/test_step_checkpoints.py, each scheduler family).

A checkpoint whose schedule differs from the one the call computed is refused in-call: the
real `prepare_latents` runs and the job starts from step 0 (`Checkpointing.refusal` says why).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from kiln.gpu_worker.pipelines.base import StepCallback
from kiln.gpu_worker.pipelines.step_checkpoint import DenoiseState, cpu_state
from kiln.gpu_worker.protocol import GenerationRequest

log = logging.getLogger(__name__)

# Pipelines whose `__call__` sets the timesteps before `prepare_latents`, loops over them with
# `if self.interrupt: continue` first, and carries no state across steps but the latents, the
# scheduler and the generators. Another pipeline runs as before: no checkpoints, restart at 0.
RESUMABLE_PIPELINES = frozenset({"StableDiffusionPipeline", "WanPipeline"})

# the scheduler's config (the recipe, checked through the identity), not its state
_SCHEDULER_CONFIG = "_internal_dict"
_SAMPLE_VALUES = 64  # values of each weight tensor the fingerprint reads


StateSink = Callable[[DenoiseState], None]


@dataclass
class Checkpointing:
    """What one run does about checkpoints: where it resumes, when it captures, and where to.

    `due(steps_done, total)` says whether to capture after that step; `sink` takes each
    capture (rank 0 writes it). `refusal` is set when `resume` was refused in the call, and the
    run started from step 0; `resumed_at` is the step it started from.
    """

    resume: DenoiseState | None = None
    due: Callable[[int, int], bool] = field(default=lambda _done, _total: False)
    sink: StateSink | None = None
    refusal: str | None = None
    resumed_at: int = 0


@runtime_checkable
class ResumedLoop(Protocol):
    """A pipeline whose denoising loop Kiln itself pauses and resumes (`DiffusersPipeline`).

    What a rank needs of it, named here so that a rank (and a node announcing its pipelines)
    need not import diffusers to ask. A pipeline with its own loop declares `StepStateHooks`.
    """

    def takes_checkpoints(self) -> bool:
        """Whether its loaded loop is one Kiln resumes (a run of one job takes checkpoints)."""
        ...

    def checkpoint_refusal(self, requests: Sequence[GenerationRequest]) -> str | None:
        """Why a run of `requests` cannot take step checkpoints; None when it can."""
        ...

    def checkpoint_identity(self, request: GenerationRequest) -> dict[str, str]:
        """What a checkpoint of `request` must have been made by to be resumed here."""
        ...

    def run(
        self,
        requests: Sequence[GenerationRequest],
        on_step_end: StepCallback,
        *,
        checkpointing: Checkpointing | None = None,
    ) -> list[list[np.ndarray]]:
        """One forward for a batch of compatible requests, resumed and captured as told."""
        ...


def resumable_refusal(pipe: Any, requests: Sequence[GenerationRequest]) -> str | None:
    """Why a run of `requests` on `pipe` cannot be checkpointed; None when it can."""
    name = type(pipe).__name__
    if name not in RESUMABLE_PIPELINES:
        return f"{name}'s denoising loop is not one Kiln resumes ({sorted(RESUMABLE_PIPELINES)})"
    if len(requests) != 1:
        return f"a batch of {len(requests)} requests (a checkpoint is one job's)"
    return None


def weights_fingerprint(components: Mapping[str, Any]) -> str:
    """sha256 over every model component's config and weights (names, shapes, dtypes, samples).

    `components`: a diffusers pipeline's `components`, or any name → module map (what is not a
    `torch.nn.Module` is left out). Each tensor contributes its name, shape, dtype and up to 64
    evenly spaced values, so two loads of the same weights agree and different weights (another
    seed, a fine-tune) differ without hashing gigabytes.
    """
    digest = hashlib.sha256()
    for name, component in sorted(components.items()):
        if not isinstance(component, torch.nn.Module):
            continue
        config = getattr(component, "config", None)
        digest.update(f"{name}|{type(component).__name__}|".encode())
        if config is not None:  # diffusers' FrozenDict, or a transformers config
            fields = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            digest.update(stable_config(fields).encode())
        for key, tensor in sorted(component.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            stride = max(1, flat.numel() // _SAMPLE_VALUES)
            sample = flat[::stride][:_SAMPLE_VALUES].to("cpu", torch.float64)
            digest.update(f"{key}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def request_digest(request: GenerationRequest) -> str:
    """sha256 of what a request computes (not its id, not its previews)."""
    fields = [
        repr(request.batch_key()),
        request.prompt,
        repr(request.negative_prompt),
        str(request.seed),
        str(request.num_outputs),
    ]
    return hashlib.sha256("\x00".join(fields).encode()).hexdigest()


# diffusers' record of which config values were defaulted: a list built from a set, so its order
# changes with each process's hash seed; the values themselves are in the config
_DEFAULTED = "_use_default_values"


def stable_config(config: Mapping[str, Any]) -> str:
    """A config as canonical JSON, equal in every process that loaded the same one."""
    fields = {name: value for name, value in config.items() if name != _DEFAULTED}
    return json.dumps(fields, sort_keys=True, default=str)


def scheduler_identity(scheduler: Any) -> str:
    """The scheduler's class and a digest of its config."""
    config = stable_config(dict(scheduler.config))
    return f"{type(scheduler).__name__}:{hashlib.sha256(config.encode()).hexdigest()[:16]}"


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """Every attribute of the scheduler but its config, copied to the CPU."""
    return {
        name: cpu_state(value, f"scheduler attribute {name}")
        for name, value in vars(scheduler).items()
        if name != _SCHEDULER_CONFIG
    }


def capture_state(
    identity: dict[str, str],
    steps_done: int,
    total: int,
    latents: torch.Tensor,
    scheduler: Any,
    generators: Sequence[torch.Generator],
) -> DenoiseState:
    """The loop's state after `steps_done` steps, as `callback_on_step_end` sees it."""
    return DenoiseState(
        identity=identity,
        steps_done=steps_done,
        total_steps=total,
        latents=latents.detach().to("cpu", copy=True),
        scheduler=scheduler_state(scheduler),
        generators=[generator.get_state() for generator in generators],
    )


def _on_device(value: Any, like: Any, device: torch.device) -> Any:
    # a restored tensor goes where the freshly set-up scheduler keeps that attribute (some keep
    # their sigmas on the CPU on purpose); history tensors go with the latents
    if isinstance(value, torch.Tensor):
        return value.to(like.device if isinstance(like, torch.Tensor) else device)
    if isinstance(value, list):
        return [_on_device(item, None, device) for item in value]
    return value


def restore_scheduler(scheduler: Any, saved: Mapping[str, Any], device: torch.device) -> None:
    """Put the saved attributes back on a scheduler whose timesteps are already set."""
    fresh = vars(scheduler)
    for name, value in saved.items():
        setattr(scheduler, name, _on_device(value, fresh.get(name), device))


def schedule_refusal(scheduler: Any, saved: Mapping[str, Any]) -> str | None:
    """Why the schedule the call computed is not the checkpoint's; None when it is."""
    for name in ("timesteps", "sigmas"):
        ours, theirs = getattr(scheduler, name, None), saved.get(name)
        if isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor):
            if not torch.equal(ours.cpu(), theirs):
                return f"the scheduler's {name} differ from the checkpoint's"
        elif ours is not None or theirs is not None:
            return f"the scheduler's {name} are not the checkpoint's"
    return None


class _SkipSteps:
    """`pipe._interrupt` while resuming: truthy for the first `steps` steps, then restores.

    The loop reads `self.interrupt` once at the top of each step; reading it as False the first
    time is the moment the state for step `steps` + 1 must be in place.
    """

    def __init__(self, steps: int, restore: Callable[[], None]) -> None:
        self._left = steps
        self._restore: Callable[[], None] | None = restore

    def __bool__(self) -> bool:
        if self._left > 0:
            self._left -= 1
            return True
        if self._restore is not None:
            restore, self._restore = self._restore, None
            restore()
        return False


@contextmanager
def resuming(
    pipe: Any,
    checkpointing: Checkpointing,
    generators: Sequence[torch.Generator],
    device: torch.device,
) -> Iterator[None]:
    """Inside, the next call of `pipe` starts at `checkpointing.resume` (see the docstring)."""
    state = checkpointing.resume
    if state is None:
        yield
        return
    real_prepare = pipe.prepare_latents

    def prepare_latents(*args: Any, **kwargs: Any) -> Any:
        refusal = schedule_refusal(pipe.scheduler, state.scheduler)
        if refusal is None and len(state.generators) != len(generators):
            refusal = f"{len(state.generators)} generators saved, the call has {len(generators)}"
        if refusal is not None:
            checkpointing.refusal = refusal
            log.warning("checkpoint at step %d refused: %s", state.steps_done, refusal)
            return real_prepare(*args, **kwargs)
        for generator, saved in zip(generators, state.generators, strict=True):
            generator.set_state(saved)
        scheduler = pipe.scheduler
        pipe._interrupt = _SkipSteps(
            state.steps_done, lambda: restore_scheduler(scheduler, state.scheduler, device)
        )
        checkpointing.resumed_at = state.steps_done
        return state.latents.to(device)

    pipe.prepare_latents = prepare_latents
    try:
        yield
    finally:
        del pipe.prepare_latents  # the instance attribute: the class's method shows again
        pipe._interrupt = False
