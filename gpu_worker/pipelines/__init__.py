"""Pipelines a rank can serve, chosen by a spec string (grammar: `gpu_worker.pipeline_specs`).

`tiny`, `tiny-video` and their image-conditioned variants · `diffusers:<folder or hub id>` ·
`python:<module>:<factory>` (a `PipelineFactory`, called with the device; docs/pipelines.md).
diffusers is imported only when a diffusers pipeline is loaded, so importing this package stays
cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.common.limits import TINY_LIMITS
from kiln.gpu_worker.lazy_exports import lazy_exports
from kiln.gpu_worker.pipeline_specs import (
    PIPELINE_MEMBERS,
    TINY_SPECS,
    NotAPipeline,
    PipelineSpec,
    SpecError,
    check_python_spec,
    check_spec_form,
    import_factory,
    parse_spec,
    tiny_base,
)
from kiln.gpu_worker.quiet import quiet_progress_bars
from kiln.gpu_worker.settings import GpuWorkerSettings

if TYPE_CHECKING:
    import torch

    from kiln.gpu_worker.pipelines.base import (
        Pipeline,
        PipelineFactory,
        PreviewDecoder,
        StepCallback,
        StepStateHooks,
        StopDenoising,
        report_latents,
    )

# What a pipeline is (`base`) needs torch; checking and preparing a spec do not, and the node
# does only those: so these names are imported lazily (PEP 562), and the node imports no torch.
_BASE = "kiln.gpu_worker.pipelines.base"
_EXPORTS = dict.fromkeys(
    (
        "Pipeline",
        "PipelineFactory",
        "PreviewDecoder",
        "StepCallback",
        "StepStateHooks",
        "StopDenoising",
        "report_latents",
    ),
    _BASE,
)

__all__ = [
    "Pipeline",
    "PipelineFactory",
    "PreviewDecoder",
    "SpecError",
    "StepCallback",
    "StepStateHooks",
    "StopDenoising",
    "check_spec",
    "load_pipeline",
    "prepare_pipeline",
    "report_latents",
]


if not TYPE_CHECKING:  # mypy sees the imports above, and so still refuses a misspelled name
    __getattr__ = lazy_exports(__name__, _EXPORTS)


def load_pipeline(
    spec: str, device: torch.device, settings: GpuWorkerSettings | None = None
) -> Pipeline:
    """Load the pipeline named by `spec` onto `device`; `SpecError` (a ValueError) if it is bad."""
    settings = settings or GpuWorkerSettings()
    parsed = parse_spec(spec)
    if parsed.kind == "python":
        return _load_python(parsed, device)
    return _load_diffusers(spec, device, settings)


def check_spec(spec: str) -> PipelineSpec:
    """Everything about `spec` that can be known without loading the model; `SpecError` if not.

    The form and the diffusers folder (`check_spec_form`); for `python:`, the module imports and
    its factory looks like one (`check_python_spec`).
    """
    parsed = check_spec_form(spec)
    if parsed.kind == "python":
        check_python_spec(parsed, PIPELINE_MEMBERS)
    return parsed


def prepare_pipeline(spec: str, settings: GpuWorkerSettings) -> None:
    """Make what `spec` loads from ready on disk; call it once, before any rank starts.

    Only the tiny pipelines are built here (saved into the model cache, verified); other specs
    load from where they already are. Ranks then find a complete folder and never build.
    """
    if spec in TINY_SPECS:
        from kiln.gpu_worker.pipelines.tiny import ensure_tiny

        ensure_tiny(tiny_base(spec), settings.model_cache)


def _load_diffusers(spec: str, device: torch.device, settings: GpuWorkerSettings) -> Pipeline:
    import torch

    from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
    from kiln.gpu_worker.pipelines.lora import adapters_from_settings

    quiet_progress_bars()
    dtype = None if settings.torch_dtype == "auto" else getattr(torch, settings.torch_dtype)
    if spec in TINY_SPECS:
        from kiln.gpu_worker.pipelines.tiny import ensure_tiny

        source = str(ensure_tiny(tiny_base(spec), settings.model_cache))
    else:
        source = spec.split(":", 1)[1]
    # The tiny pipelines declare CPU-sized limits; other models derive theirs from their configs.
    limits = TINY_LIMITS.get(tiny_base(spec))
    pipeline = DiffusersPipeline.load(source, device, name=spec, dtype=dtype, limits=limits)
    pipeline = pipeline.as_variant(spec)  # tiny-img2img etc.: the same components
    pipeline.adapters = adapters_from_settings(pipeline.pipe, settings)
    return pipeline


def _load_python(parsed: PipelineSpec, device: torch.device) -> Pipeline:
    from kiln.gpu_worker.pipelines.base import Pipeline, missing_members

    factory: PipelineFactory = import_factory(parsed)
    pipeline = factory(device)
    if not isinstance(pipeline, Pipeline):
        missing = ", ".join(missing_members(pipeline))
        raise NotAPipeline(
            f"{parsed.text}: {parsed.factory}(device) returned {type(pipeline).__name__}, not a "
            f"Pipeline: it lacks {missing} (docs/pipelines.md)"
        )
    return pipeline
