"""Default limits of a diffusers pipeline, derived from what the model itself says it makes.

Also the model's geometry the limits and checks need: its denoiser, the size grid, the frame rule.

A model's native size and frame count come from its `__call__` defaults (Wan: 832×480, 81 frames)
or from its sample size times the VAE's scale factor (Stable Diffusion: 64 × 8 = 512). Around
that: sides up to twice native, steps up to four times the pipeline's default, and a budget of
four native outputs (pixels × frames × outputs) per request: beyond those a request is a mistake
or a memory blow-up rather than a better picture. A deployment that knows better declares its own
limits (a `python:` factory pipeline with `limits()`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.common.limits import DeclaredLimits
from kiln.common.request import MAX_SIDE, MAX_STEPS

FALLBACK_SIDE = 1024
FALLBACK_STEPS = 50
FALLBACK_VIDEO_FRAMES = 81  # Wan 2.1's clip length
SIDE_FACTOR = 2
STEPS_FACTOR = 4
NATIVE_OUTPUTS_BUDGET = 4


def derive_limits(
    pipe: Any,
    call_defaults: Mapping[str, Any],
    *,
    size_multiple: int,
    temporal: int | None,
    denoiser: Any,
) -> DeclaredLimits:
    """Limits around the model's native size; `temporal` is the VAE's frame compression (video)."""
    width, height = native_size(pipe, call_defaults, denoiser)
    side = min(MAX_SIDE, SIDE_FACTOR * max(width, height))
    side -= side % size_multiple
    frames = 1
    if temporal is not None:
        frames = _int_or(call_defaults.get("num_frames"), FALLBACK_VIDEO_FRAMES)
        frames -= (frames - 1) % temporal  # the largest count the frame rule allows
    steps = _int_or(call_defaults.get("num_inference_steps"), FALLBACK_STEPS)
    return DeclaredLimits(
        max_width=side,
        max_height=side,
        size_multiple=size_multiple,
        max_steps=min(MAX_STEPS, STEPS_FACTOR * steps),
        min_frames=1,
        max_frames=frames,
        frame_step=temporal or 1,
        max_pixels_frames_outputs=width * height * frames * NATIVE_OUTPUTS_BUDGET,
    )


def native_size(pipe: Any, call_defaults: Mapping[str, Any], denoiser: Any) -> tuple[int, int]:
    """(width, height) the model makes when not told: its call defaults, else sample × scale."""
    width, height = call_defaults.get("width"), call_defaults.get("height")
    if isinstance(width, int) and isinstance(height, int):
        return width, height
    sample: Any = getattr(pipe, "default_sample_size", None)
    sample = sample or getattr(getattr(denoiser, "config", None), "sample_size", None)
    if isinstance(sample, (tuple, list)):
        sample = max(sample)
    scale = getattr(pipe, "vae_scale_factor", None) or 8
    if not isinstance(sample, int) or not isinstance(scale, int):
        return FALLBACK_SIDE, FALLBACK_SIDE
    return sample * scale, sample * scale


def _int_or(value: object, fallback: int) -> int:
    return value if isinstance(value, int) and value >= 1 else fallback


def find_denoiser(pipe: Any) -> torch.nn.Module | None:
    """The per-step module: the pipeline's transformer, else its unet; None without either."""
    for attribute in ("transformer", "unet"):
        module = getattr(pipe, attribute, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def temporal_factor(pipe: Any) -> int:
    """Frames per latent frame: a video VAE takes 1 + temporal * k frames (Wan: 4)."""
    return int(getattr(pipe, "vae_scale_factor_temporal", 1) or 1)


def size_multiple(pipe: Any, denoiser: Any) -> int:
    """Pixels per latent cell times the denoiser's spatial patch.

    What the pipeline would otherwise silently round a width or height down to.
    """
    spatial: Any = getattr(pipe, "vae_scale_factor_spatial", None)
    spatial = spatial or getattr(pipe, "vae_scale_factor", 8)
    patch: Any = getattr(getattr(denoiser, "config", None), "patch_size", None) or 1
    if isinstance(patch, (tuple, list)):
        patch = patch[-1]
    return int(spatial) * int(patch)
