"""A `python:` pipeline whose loop takes step checkpoints through the save/restore hooks.

`DriftingPipeline` denoises for real in miniature: its latents start as seeded noise and each step
mixes them through a small module and adds fresh noise drawn from the request's own generator, so
a run's output depends on the latents *and* the generator's state at every step. Resuming from a
step therefore gives the uninterrupted run's bytes only when both were saved and restored, which
is what the tests check. Its state is kept on the pipeline while a run is under way (`_loop`,
what `save_state` returns) and a state to resume from waits in `_resume` for the next `run`.
Each step also sleeps `KILN_TEST_STEP_SECONDS` (default 0), for runs that stand in for long ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kiln.common.limits import DeclaredLimits
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.pipelines.base import StepCallback
from kiln.gpu_worker.protocol import GenerationRequest
from tests.e2e.pipelines import STEP_SECONDS_ENV

CHANNELS = 4
SCALE = 8  # pixels per latent, as a VAE's
UNSAVEABLE = "unsaveable"  # a prompt whose state holds what no checkpoint can (an open handle)


class DriftingPipeline:
    """Seeded latents drifting through a fixed 4x4 mixer and per-step seeded noise."""

    name = "drifting"
    state_version = "1"  # changes when the saved state's layout does: older ones are refused

    def __init__(self, device: torch.device) -> None:
        self.device = device
        weights = torch.Generator().manual_seed(0)
        self.mixer = torch.nn.Linear(CHANNELS, CHANNELS).to(device)
        with torch.no_grad():
            self.mixer.weight.copy_(torch.randn(CHANNELS, CHANNELS, generator=weights) * 0.5)
            self.mixer.bias.copy_(torch.randn(CHANNELS, generator=weights) * 0.1)
        self.step_s = float(os.environ.get(STEP_SECONDS_ENV, "0"))
        self._loop: dict[str, Any] = {}
        self._resume: tuple[Mapping[str, Any], int] | None = None

    def supported_fields(self) -> frozenset[str]:
        return frozenset({"prompt", "width", "height", "steps", "seed", "num_outputs"})

    def limits(self) -> DeclaredLimits:
        return DeclaredLimits(max_width=256, max_height=256, max_steps=100, max_frames=1)

    def validate(self, request: GenerationRequest) -> None:
        if request.num_frames != 1:
            raise UnsupportedRequest("num_frames: drifting makes images")

    def denoiser(self) -> torch.nn.Module | None:
        return None  # the mixer is too small to split across ranks

    def save_state(self, step: int, total: int) -> Mapping[str, Any]:
        if self._loop.get("step") != step:  # Kiln asks only between steps, for the one just done
            raise RuntimeError(f"asked for step {step} of {total}, the loop is elsewhere")
        return dict(self._loop)

    def restore_state(self, state: Mapping[str, Any], step: int, total: int) -> None:
        if not 0 < step < total:
            raise ValueError(f"step {step} of {total} is no point to go on from")
        if not isinstance(state.get("latents"), torch.Tensor):
            raise ValueError("the state has no latents")
        if not isinstance(state.get("generators"), list):
            raise ValueError("the state has no generator states")
        self._resume = (state, step)

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        first = requests[0]
        shape = (first.height // SCALE, first.width // SCALE)
        resume, self._resume = self._resume, None
        generators = [torch.Generator().manual_seed(r.seed) for r in requests]
        if resume is None:
            done = 0
            latents = torch.cat(
                [
                    torch.randn(r.num_outputs, CHANNELS, *shape, generator=generator)
                    for r, generator in zip(requests, generators, strict=True)
                ]
            )
        else:
            state, done = resume
            latents = state["latents"].clone()
            for generator, saved in zip(generators, state["generators"], strict=True):
                generator.set_state(saved)
        with torch.no_grad():
            for step in range(done + 1, first.steps + 1):
                noise = torch.cat(
                    [
                        torch.randn(r.num_outputs, CHANNELS, *shape, generator=generator)
                        for r, generator in zip(requests, generators, strict=True)
                    ]
                )
                mixed = self.mixer(latents.to(self.device).movedim(1, -1)).movedim(-1, 1).cpu()
                latents = 0.8 * torch.tanh(mixed) + 0.2 * noise
                time.sleep(self.step_s)
                self._loop = {
                    "step": step,
                    "latents": latents,
                    "generators": [g.get_state() for g in generators],
                }
                if first.prompt == UNSAVEABLE:
                    self._loop["handle"] = object()
                on_step_end(step, first.steps)
        self._loop = {}
        return self._images(requests, latents)

    def _images(
        self, requests: Sequence[GenerationRequest], latents: torch.Tensor
    ) -> list[list[np.ndarray]]:
        pixels = torch.nn.functional.interpolate(latents[:, :3], scale_factor=SCALE)
        rgb = ((pixels.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        frames = rgb.permute(0, 2, 3, 1).numpy()[:, None]  # (outputs, 1, H, W, 3)
        outputs, start = [], 0
        for request in requests:
            outputs.append([frames[start + i] for i in range(request.num_outputs)])
            start += request.num_outputs
        return outputs


def make(device: torch.device) -> DriftingPipeline:
    return DriftingPipeline(device)


class ForgetfulPipeline(DriftingPipeline):
    """Saves its latents but not where its generators were: a resumed run draws other noise."""

    def save_state(self, step: int, total: int) -> Mapping[str, Any]:
        state = dict(super().save_state(step, total))
        state["generators"] = [torch.Generator().get_state() for _ in state["generators"]]
        return state


def forgetful(device: torch.device) -> ForgetfulPipeline:
    return ForgetfulPipeline(device)


class StubbornPipeline(DriftingPipeline):
    """Refuses every state it is given back (an author's restore that checks the wrong thing)."""

    def restore_state(self, state: Mapping[str, Any], step: int, total: int) -> None:
        raise ValueError(f"cannot go on from step {step} of {total} ({len(state)} parts given)")


def stubborn(device: torch.device) -> StubbornPipeline:
    return StubbornPipeline(device)
