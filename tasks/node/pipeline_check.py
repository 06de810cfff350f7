"""`kiln pipeline check SPEC`: load a pipeline in this process and run it as a node would.

What a model author runs before serving a pipeline (docs/pipelines.md): the spec is loaded as a
rank loads it (the working directory importable), then a one-step request at the pipeline's
smallest size (the job contract's smallest side, rounded up to the pipeline's size multiple; its
fewest frames) goes through `validate` and `run`; what `run` returns must be, per request and per
output, a uint8 array (frames, height, width, 3), and `on_step_end` must have been called. Then a
two-step request whose `on_step_end` raises `StopDenoising` after step 1 must end `run` with that
exception, with no further step: that is how a cancel stops a forward on every rank. A pipeline
with the save/restore hooks (`StepStateHooks`) must resume: a four-step run is checkpointed after
step 2 through Kiln's own capture, the state encoded and decoded as a node stores it, and a run
resumed from it must call `on_step_end` for steps 3 and 4 only and return the same bytes as the
run never stopped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kiln.common.limits import DeclaredLimits
from kiln.common.request import MIN_SIDE, SIZE_MULTIPLE, InputSchema
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.inputs import declared_input_schema
from kiln.gpu_worker.limits import declared_limits
from kiln.gpu_worker.pipeline_specs import check_spec_form, one_line
from kiln.gpu_worker.pipelines import (
    Pipeline,
    SpecError,
    StepStateHooks,
    StopDenoising,
    load_pipeline,
    prepare_pipeline,
)
from kiln.gpu_worker.pipelines.diffusers_resume import Checkpointing
from kiln.gpu_worker.pipelines.hooked_resume import hooks_identity, run_with_hooks
from kiln.gpu_worker.pipelines.step_checkpoint import (
    CheckpointRefused,
    DenoiseState,
    decode,
    encode,
)
from kiln.gpu_worker.previews import check_preview_hook
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.tasks.contract.schemas import JobRequest

__all__ = ["CheckFailed", "PipelineReport", "SpecError", "check_pipeline", "smallest_request"]


class CheckFailed(Exception):
    """The pipeline loaded but does not behave as a node needs; the message is one line."""


@dataclass(frozen=True)
class PipelineReport:
    """What a passing check saw: the pipeline, its declarations, the request and its outputs."""

    spec: str
    name: str
    device: str
    fields: frozenset[str]
    limits: DeclaredLimits
    inputs: InputSchema | None
    request: GenerationRequest
    output_shapes: list[tuple[int, ...]]
    steps_reported: int
    load_s: float
    run_s: float
    resumes: bool = False  # it has the save/restore hooks, and a run resumed byte-identical


def check_pipeline(
    spec: str, device: str = "cpu", settings: GpuWorkerSettings | None = None
) -> PipelineReport:
    """Load `spec` on `device` and run the checks; `SpecError` or `CheckFailed` (one line)."""
    settings = settings or GpuWorkerSettings()
    started = time.monotonic()
    check_spec_form(spec)  # what `kiln worker` refuses before any rank, refused here alike
    try:
        prepare_pipeline(spec, settings)
        pipeline = load_pipeline(spec, torch.device(device), settings)
    except SpecError:
        raise
    except Exception as exc:  # the factory or the model's own loading failed: say how, once
        raise CheckFailed(f"loading {spec} on {device} raised {one_line(exc)}") from exc
    load_s = time.monotonic() - started
    name = _checked_name(pipeline)
    fields = _call("supported_fields()", pipeline.supported_fields)
    if not isinstance(fields, frozenset | set) or not all(isinstance(f, str) for f in fields):
        raise CheckFailed(f"supported_fields() returned {fields!r}; expected a frozenset of str")
    limits = _call("limits()", lambda: declared_limits(pipeline))
    inputs = _call("input_schema()", lambda: declared_input_schema(pipeline))
    request = smallest_request(name, limits, frozenset(fields))
    try:
        pipeline.validate(request)
    except UnsupportedRequest as exc:
        raise CheckFailed(
            f"validate() refused the smallest request ({_shape(request)}): {exc}"
        ) from None
    started = time.monotonic()
    shapes, steps_reported = _run_once(pipeline, request)
    run_s = time.monotonic() - started
    _check_stop(pipeline, replace(request, request_id="check-stop", steps=2))
    hook = replace(request, request_id="check-preview", steps=2)
    _call("the preview hook", lambda: check_preview_hook(pipeline, hook))
    resumes = isinstance(pipeline, StepStateHooks)
    if resumes:
        check_resume(pipeline, replace(request, request_id="check-resume", steps=RESUME_STEPS))
    return PipelineReport(
        spec, name, device, frozenset(fields), limits, inputs, request, shapes, steps_reported,
        load_s, run_s, resumes,
    )  # fmt: skip


RESUME_STEPS = 4  # the resume check's run: checkpointed after step 2, resumed for 3 and 4
_RESUME_AT = 2


def check_resume(pipeline: Pipeline, request: GenerationRequest) -> None:
    """A run resumed after step 2 from what `save_state` gave equals the run never stopped."""
    identity = hooks_identity(pipeline, request)
    saved: list[DenoiseState] = []
    at_step_2 = Checkpointing(due=lambda done, _total: done == _RESUME_AT, sink=saved.append)
    whole = _call(
        "run() with a checkpoint after step 2",
        lambda: run_with_hooks(pipeline, [request], _no_stop, at_step_2, identity),
    )
    if len(saved) != 1:
        raise CheckFailed(
            "save_state() gave no state after step 2 (it raised, or returned no mapping of "
            "tensors, numbers, strings, lists and str-keyed dicts: the worker log says which)"
        )
    try:
        stored = decode(encode(saved[0]), identity)  # as a node writes it and a later one reads it
    except CheckpointRefused as exc:
        raise CheckFailed(f"the state save_state() gave does not read back: {exc}") from None
    steps: list[int] = []
    resuming = Checkpointing(resume=stored)
    resumed = _call(
        "run() resumed after step 2",
        lambda: run_with_hooks(
            pipeline, [request], lambda step, _total: steps.append(step), resuming, identity
        ),
    )
    if resuming.refusal is not None:
        raise CheckFailed(f"restore_state() refused what save_state() gave: {resuming.refusal}")
    if steps != list(range(_RESUME_AT + 1, request.steps + 1)):
        raise CheckFailed(
            f"a run resumed after step 2 called on_step_end for steps {steps}; expected "
            f"{list(range(_RESUME_AT + 1, request.steps + 1))} (it must go on where it was)"
        )
    same = all(
        a.tobytes() == b.tobytes() for a, b in zip(whole[0], resumed[0], strict=True)
    ) and len(whole[0]) == len(resumed[0])
    if not same:
        raise CheckFailed(
            "a run resumed after step 2 returned other outputs than the run never stopped: "
            "save_state() must return everything the later steps read (latents, every random "
            "generator's get_state(), a scheduler's history)"
        )


def _no_stop(_step: int, _total: int) -> None:
    return None


def smallest_request(
    pipeline: str, limits: DeclaredLimits, fields: frozenset[str]
) -> GenerationRequest:
    """One step at the smallest size a job may ask of this pipeline, its fewest frames."""
    multiple = math.lcm(SIZE_MULTIPLE, limits.get("size_multiple", SIZE_MULTIPLE))
    side = math.ceil(MIN_SIDE / multiple) * multiple
    frames = max(1, limits.get("min_frames", 1)) if "num_frames" in fields else 1
    step = limits.get("frame_step", 1)
    while step > 1 and (frames - 1) % step:
        frames += 1
    return GenerationRequest(
        request_id="check",
        pipeline=pipeline,
        prompt="a kiln, checked",
        width=side,
        height=side,
        steps=1,
        seed=0,
        num_frames=frames,
        guidance_scale=JobRequest.model_fields["guidance_scale"].default,
    )


def _checked_name(pipeline: Pipeline) -> str:
    name = getattr(pipeline, "name", None)
    if not isinstance(name, str) or not name:
        raise CheckFailed(f"the pipeline's name is {name!r}; expected a non-empty str")
    return name


def _call(what: str, function: Any) -> Any:
    try:
        return function()
    except Exception as exc:
        raise CheckFailed(f"{what} raised {one_line(exc)}") from exc


def _run_once(pipeline: Pipeline, request: GenerationRequest) -> tuple[list[tuple[int, ...]], int]:
    reported: list[tuple[int, int]] = []
    try:
        outputs = pipeline.run([request], lambda step, total: reported.append((step, total)))
    except Exception as exc:
        raise CheckFailed(
            f"run() of the smallest request ({_shape(request)}) raised {one_line(exc)}"
        ) from exc
    shapes = check_outputs(outputs, [request])
    if not reported:
        raise CheckFailed(
            "run() never called on_step_end(step, total): without it a job shows no progress "
            "and cannot be canceled"
        )
    return shapes, len(reported)


def check_outputs(outputs: object, requests: Sequence[GenerationRequest]) -> list[tuple[int, ...]]:
    """The shapes of what `run` returned; `CheckFailed` naming the first thing that is wrong."""
    if not isinstance(outputs, list) or len(outputs) != len(requests):
        raise CheckFailed(
            f"run() returned {_describe(outputs)}; expected a list with one list of outputs per "
            f"request ({len(requests)})"
        )
    shapes = []
    for index, (per_request, request) in enumerate(zip(outputs, requests, strict=True)):
        if not isinstance(per_request, list) or len(per_request) != request.num_outputs:
            raise CheckFailed(
                f"run()[{index}] is {_describe(per_request)}; expected a list of "
                f"num_outputs={request.num_outputs} arrays"
            )
        expected = (request.num_frames, request.height, request.width, 3)
        for number, frames in enumerate(per_request):
            where = f"run()[{index}][{number}]"
            if not isinstance(frames, np.ndarray):
                raise CheckFailed(f"{where} is {_describe(frames)}; expected a numpy array")
            if frames.dtype != np.uint8:
                raise CheckFailed(f"{where} has dtype {frames.dtype}; expected uint8 (0-255)")
            if frames.shape != expected:
                raise CheckFailed(
                    f"{where} has shape {frames.shape}; expected (frames, height, width, 3) = "
                    f"{expected}"
                )
            shapes.append(frames.shape)
    return shapes


def _check_stop(pipeline: Pipeline, request: GenerationRequest) -> None:
    steps: list[int] = []

    def stop_after_first(step: int, total: int) -> None:
        steps.append(step)
        raise StopDenoising(f"check: stop after step {step} of {total}")

    try:
        pipeline.run([request], stop_after_first)
    except StopDenoising:
        if len(steps) > 1:
            raise CheckFailed(
                f"run() called on_step_end {len(steps)} times after it raised StopDenoising"
            ) from None
        return
    except Exception as exc:
        raise CheckFailed(
            f"run() raised {one_line(exc)} when on_step_end raised StopDenoising; let "
            "StopDenoising propagate (a cancel stops the forward that way)"
        ) from exc
    raise CheckFailed(
        f"run() went on after on_step_end raised StopDenoising (on_step_end called for steps "
        f"{steps}, then run() returned); let StopDenoising propagate so a cancel stops the forward"
    )


def _shape(request: GenerationRequest) -> str:
    frames = f", {request.num_frames} frames" if request.num_frames > 1 else ""
    return f"{request.width}×{request.height}, {request.steps} step{frames}"


def _describe(value: object) -> str:
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"
