"""Warm-up before a node takes jobs: the shapes asked for (`--warmup WxHxSTEPS[xFRAMES]`).

With `--compile` a warm-up shape is also a compile: torch.compile specialises on input shapes, so
each shape a node will serve compiles here, before the first job, and not inside it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.protocol import GenerationRequest

if TYPE_CHECKING:  # parsing shapes (settings) must not import torch
    from kiln.gpu_worker.pipelines.base import Pipeline

logger = logging.getLogger(__name__)

# Above 1, so the warm-up also runs the classifier-free-guidance path real requests take.
WARMUP_GUIDANCE = 5.0
_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)(?:x(\d+))?$")


@dataclass(frozen=True)
class WarmupShape:
    """One warm-up request's size: width x height, denoising steps, frames (1 = image)."""

    width: int
    height: int
    steps: int
    frames: int = 1

    def request(self, pipeline: str) -> GenerationRequest:
        """The warm-up request of this shape for `pipeline`."""
        return GenerationRequest(
            request_id=f"warmup:{pipeline}:{self}",
            pipeline=pipeline,
            prompt="warm-up",
            width=self.width,
            height=self.height,
            steps=self.steps,
            seed=0,
            num_frames=self.frames,
            guidance_scale=WARMUP_GUIDANCE,
        )

    def __str__(self) -> str:
        frames = f"x{self.frames}" if self.frames != 1 else ""
        return f"{self.width}x{self.height}x{self.steps}{frames}"


def parse_warmup_shape(text: str) -> WarmupShape:
    """`512x512x25` or `512x512x25x9` (frames); ValueError naming the expected form."""
    match = _SHAPE.match(text.strip().lower())
    if match is None:
        raise ValueError(f"warm-up shape {text!r}: expected WIDTHxHEIGHTxSTEPS[xFRAMES]")
    width, height, steps, frames = (int(part) if part else 1 for part in match.groups())
    if min(width, height, steps, frames) < 1:
        raise ValueError(f"warm-up shape {text!r}: every number must be at least 1")
    return WarmupShape(width, height, steps, frames)


# Without asked-for shapes: one small request, as an image, else as a short video.
DEFAULT_SHAPES = (WarmupShape(64, 64, 2), WarmupShape(64, 64, 2, 9))


def warm_up(name: str, pipeline: Pipeline, shapes: tuple[WarmupShape, ...] = ()) -> int:
    """Run each shape `pipeline` accepts (every rank alike); the number of shapes run.

    Without `shapes`, the first default shape the pipeline accepts, so the first job is not slow.
    """
    candidates = shapes or DEFAULT_SHAPES
    ran = 0
    for shape in candidates:
        request = shape.request(name)
        try:
            pipeline.validate(request)
        except UnsupportedRequest as exc:
            if shapes:  # asked for by the operator: say why it was skipped
                logger.warning("pipeline %s: warm-up %s skipped: %s", name, shape, exc)
            continue
        pipeline.run([request], lambda _step, _total: None)
        ran += 1
        if not shapes:
            return ran
    if ran == 0:
        logger.info("pipeline %s accepts no warm-up request asked for; not warmed up", name)
    return ran
