"""What a pipeline may declare it takes (`DeclaredLimits`), and the tiny pipelines' declarations.

Nodes announce declared limits in their heartbeat; the API parses them
(`kiln.tasks.contract.limits.PipelineLimits`) and, for a built-in name no live node announces yet,
falls back to `TINY_LIMITS`, which the tiny pipelines declare on their ranks. Every key is
optional; a missing one means no limit beyond the job schema's own ranges.
"""

from __future__ import annotations

from typing import TypedDict


class DeclaredLimits(TypedDict, total=False):
    """A pipeline's limits as announced (JSON keys)."""

    max_width: int
    max_height: int
    size_multiple: int  # width and height must be multiples of it
    max_steps: int
    min_frames: int
    max_frames: int
    frame_step: int  # num_frames must be frame_step * k + 1 (4 for Wan-style video)
    max_pixels_frames_outputs: int  # width × height × num_frames × num_outputs: the memory budget
    max_preview_side: int  # a preview's longer side (`preview.max_side`), at most
    min_preview_every_steps: int  # `preview.every_steps` at least: previews at most every N steps


LIMIT_KEYS = frozenset(DeclaredLimits.__annotations__)

# The tiny pipelines run on CPU ranks: budgets that keep a forward within a few hundred MiB and a
# few seconds, sizes that leave room for the README's 512×512 example. Their previews may come
# after every step (a fitted linear map costs little, tests/benchmarks/bench_previews.py), at most
# half the output's side (a tiny autoencoder decodes at full size).
TINY_LIMITS: dict[str, DeclaredLimits] = {
    "tiny": DeclaredLimits(
        max_width=1024,
        max_height=1024,
        size_multiple=8,
        max_steps=200,
        min_frames=1,
        max_frames=1,
        frame_step=1,
        max_pixels_frames_outputs=1024 * 1024 * 4,
        max_preview_side=512,
        min_preview_every_steps=1,
    ),
    "tiny-dit": DeclaredLimits(
        max_width=512,
        max_height=512,
        size_multiple=16,  # 8x VAE, latents packed 2x2
        max_steps=200,
        min_frames=1,
        max_frames=1,
        frame_step=1,
        max_pixels_frames_outputs=512 * 512 * 4,
        max_preview_side=256,
        min_preview_every_steps=1,
    ),
    "tiny-video": DeclaredLimits(
        max_width=512,
        max_height=512,
        size_multiple=16,
        max_steps=200,
        min_frames=1,
        max_frames=81,
        frame_step=4,
        max_pixels_frames_outputs=256 * 256 * 81,
        max_preview_side=256,
        min_preview_every_steps=1,
    ),
}
