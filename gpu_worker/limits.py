"""What a pipeline declares it can take: sizes, steps, frame counts and a memory budget.

Plain, torch-free data. A pipeline may define `limits() -> DeclaredLimits` (optional in the
`Pipeline` protocol); rank 0 sends what its pipelines declare to the group's owner when it is ready,
and the node publishes it in its heartbeat. `tasks.limits.PipelineLimits` parses and enforces the
same keys: the API process must not import gpu_worker, so the JSON keys are the contract. Every key
is optional; a missing one means no limit beyond the job schema's own ranges.
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


LIMIT_KEYS = frozenset(DeclaredLimits.__annotations__)

# The tiny pipelines run on CPU ranks: budgets that keep a forward within a few hundred MiB and a
# few seconds, sizes that leave room for the README's 512×512 example. `tasks.limits` holds the
# same numbers as its static defaults (it cannot import this package); a test keeps them equal.
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
    ),
}


def declared_limits(pipeline: object) -> DeclaredLimits:
    """What `pipeline.limits()` declares (a copy); nothing when the pipeline has no `limits`."""
    limits = getattr(pipeline, "limits", None)
    if limits is None:
        return DeclaredLimits()
    declared: DeclaredLimits = limits()
    unknown = set(declared) - LIMIT_KEYS
    if unknown:  # a typo would otherwise silently announce no limit at all
        raise ValueError(f"unknown limit(s) {sorted(unknown)}; known: {sorted(LIMIT_KEYS)}")
    return DeclaredLimits(**declared)
