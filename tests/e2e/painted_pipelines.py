"""A `python:` fixture pipeline that emits previews through the protocol's preview hook.

`PaintedPipeline` paints each output as a colour ramp drawn from the seed, revealed a little more
at every step. Its "latents" are the pixels themselves, in [-1, 1], so the decoder it names is the
identity; it hands them to `report_latents` after every step, as docs/pipelines.md shows. Images
and videos (up to 16 frames).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from kiln.common.limits import DeclaredLimits
from kiln.gpu_worker.pipelines import PreviewDecoder, StepCallback, report_latents
from kiln.gpu_worker.protocol import GenerationRequest

STEP_SECONDS_ENV = "KILN_TEST_STEP_SECONDS"


def final_pixels(request: GenerationRequest, index: int) -> torch.Tensor:
    """One output's finished image, (3, height, width) in [-1, 1]: a ramp from a seeded colour."""
    generator = torch.Generator().manual_seed(request.seed + index)
    colour = torch.rand((3, 1, 1), generator=generator) * 2 - 1
    ramp = torch.linspace(-1, 1, request.width).view(1, 1, -1)
    return ((colour + ramp) / 2).expand(3, request.height, request.width).clone()


class PaintedPipeline:
    """Reveals each output step by step; its step's pixels are its previews."""

    name = "painted"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_seconds = float(os.environ.get(STEP_SECONDS_ENV, "0.05"))

    def supported_fields(self) -> frozenset[str]:
        return frozenset(
            {"prompt", "width", "height", "steps", "seed", "num_frames", "num_outputs"}
        )

    def limits(self) -> DeclaredLimits:
        return DeclaredLimits(
            max_width=256, max_height=256, max_steps=50, max_frames=16, max_preview_side=128
        )

    def validate(self, request: GenerationRequest) -> None:
        del request  # every request within its limits is served

    def preview_decoder(self) -> PreviewDecoder:
        return lambda latents: latents  # the "latents" are pixels in [-1, 1] already

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        steps = requests[0].steps
        finals = torch.stack([final_pixels(r, i) for r in requests for i in range(r.num_outputs)])
        for step in range(1, steps + 1):
            time.sleep(self.step_seconds)
            report_latents(on_step_end, step, steps, finals * (step / steps))
            on_step_end(step, steps)
        pixels = ((finals + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        images = pixels.permute(0, 2, 3, 1).numpy()  # (outputs, height, width, 3)
        outputs: list[list[np.ndarray]] = []
        row = 0
        for r in requests:
            frames = [
                np.repeat(images[row + i][None], r.num_frames, axis=0) for i in range(r.num_outputs)
            ]
            outputs.append(frames)
            row += r.num_outputs
        return outputs

    def denoiser(self) -> torch.nn.Module | None:
        return None


def painted(device: torch.device) -> PaintedPipeline:
    """`python:tests.e2e.painted_pipelines:painted`."""
    return PaintedPipeline(device)
