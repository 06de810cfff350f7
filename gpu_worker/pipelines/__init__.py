"""Pipelines a rank can serve, chosen by a spec string.

Spec grammar: `tiny` (tiny text-to-image) · `tiny-video` (tiny text-to-video) ·
`tiny-img2img`, `tiny-inpaint`, `tiny-i2v` (their components, image-conditioned) ·
`diffusers:<folder or hub id>` · `python:<module>:<factory>` (a `PipelineFactory`, called with
the device; test fixtures and custom pipelines use it). diffusers is imported only when a
diffusers pipeline is loaded, so importing this package stays cheap.
"""

from __future__ import annotations

import importlib

import torch

from kiln.gpu_worker.limits import TINY_LIMITS
from kiln.gpu_worker.pipelines.base import Pipeline, PipelineFactory, StepCallback, StopDenoising
from kiln.gpu_worker.pipelines.image_pipelines import TINY_VARIANTS, as_variant, tiny_base
from kiln.gpu_worker.settings import GpuWorkerSettings

__all__ = [
    "Pipeline",
    "PipelineFactory",
    "StepCallback",
    "StopDenoising",
    "load_pipeline",
    "prepare_pipeline",
]

TINY_SPECS = frozenset({"tiny", "tiny-video", *TINY_VARIANTS})
SPEC_GRAMMAR = (
    "tiny | tiny-video | tiny-img2img | tiny-inpaint | tiny-i2v | diffusers:<folder or hub id> | "
    "python:<module>:<factory>"
)


def load_pipeline(
    spec: str, device: torch.device, settings: GpuWorkerSettings | None = None
) -> Pipeline:
    """Load the pipeline named by `spec` onto `device`; raise ValueError for a malformed spec."""
    settings = settings or GpuWorkerSettings()
    scheme, _, target = spec.partition(":")
    if spec in TINY_SPECS or (scheme == "diffusers" and target):
        return _load_diffusers(spec, device, settings)
    if scheme == "python" and target:
        return _load_python(spec, target, device)
    raise ValueError(f"unknown pipeline spec {spec!r}; expected {SPEC_GRAMMAR}")


def prepare_pipeline(spec: str, settings: GpuWorkerSettings) -> None:
    """Make what `spec` loads from ready on disk; call it once, before any rank starts.

    Only the tiny pipelines are built here (saved into the model cache, verified); other specs
    load from where they already are. Ranks then find a complete folder and never build.
    """
    if spec in TINY_SPECS:
        from kiln.gpu_worker.pipelines.tiny import ensure_tiny

        _quiet_progress_bars()
        ensure_tiny(tiny_base(spec), settings.model_cache)


def _quiet_progress_bars() -> None:
    import diffusers
    import transformers

    # Workers and ranks log to files; save/load progress bars there are only noise.
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _load_diffusers(spec: str, device: torch.device, settings: GpuWorkerSettings) -> Pipeline:
    from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
    from kiln.gpu_worker.pipelines.lora import adapters_from_settings

    _quiet_progress_bars()
    dtype = None if settings.torch_dtype == "auto" else getattr(torch, settings.torch_dtype)
    if spec in TINY_SPECS:
        from kiln.gpu_worker.pipelines.tiny import ensure_tiny

        source = str(ensure_tiny(tiny_base(spec), settings.model_cache))
    else:
        source = spec.split(":", 1)[1]
    # The tiny pipelines declare CPU-sized limits; other models derive theirs from their configs.
    limits = TINY_LIMITS.get(tiny_base(spec))
    pipeline = DiffusersPipeline.load(source, device, name=spec, dtype=dtype, limits=limits)
    pipeline = as_variant(pipeline, spec)  # tiny-img2img etc.: the same components
    pipeline.adapters = adapters_from_settings(pipeline.pipe, settings)
    return pipeline


def _load_python(spec: str, target: str, device: torch.device) -> Pipeline:
    module_name, _, factory_name = target.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"pipeline spec {spec!r} must be python:<module>:<factory>")
    factory: PipelineFactory = getattr(importlib.import_module(module_name), factory_name)
    pipeline = factory(device)
    if not isinstance(pipeline, Pipeline):
        raise TypeError(f"{spec}: the factory returned {type(pipeline).__name__}, not a Pipeline")
    return pipeline
