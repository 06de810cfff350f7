"""One call of a diffusers pipeline for a batch: its arguments, its step hook, its frames.

A batch is one call: one prompt and one seeded generator per output (so an output's pixels do not
depend on what it was batched with), the first request's shared settings (size, steps, guidance,
frames, extra inputs, image inputs), the step hook the pipeline offers, and `output_type="np"`;
the frames that come back are checked against the size asked for and split per output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kiln.common.request import SEED_MAX, InputSchema, InputValue
from kiln.gpu_worker.errors import JobFailed
from kiln.gpu_worker.inputs import extra_input_names
from kiln.gpu_worker.pipelines.base import LatentsObserver, StepCallback
from kiln.gpu_worker.pipelines.diffusers_schedulers import SCHEDULER_INPUT
from kiln.gpu_worker.protocol import GenerationRequest

# (steps done, total steps, the latents after that step)
LatentsHook = Callable[[int, int, torch.Tensor], None]


def output_seed(seed: int, index: int) -> int:
    """Seed of output `index` of a request: `seed + index`, the same whatever else is batched."""
    return (seed + index) & SEED_MAX


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float pixels in [0, 1] to uint8, rounding like diffusers' own `numpy_to_pil`."""
    scaled: np.ndarray = np.clip(frames, 0.0, 1.0) * 255.0
    return scaled.round().astype(np.uint8)


def batch_kwargs(
    requests: Sequence[GenerationRequest], call_params: frozenset[str], *, is_video: bool
) -> dict[str, Any]:
    """The request fields of a batch as call arguments (no extra inputs, no step hook)."""
    first = requests[0]
    prompts = [r.prompt for r in requests for _ in range(r.num_outputs)]
    generators = [
        torch.Generator(device="cpu").manual_seed(output_seed(r.seed, i))
        for r in requests
        for i in range(r.num_outputs)
    ]
    kwargs: dict[str, Any] = {
        "prompt": prompts,
        "width": first.width,
        "height": first.height,
        "num_inference_steps": first.steps,
        "generator": generators,
        "output_type": "np",
    }
    if "negative_prompt" in call_params:
        # "" for a request without one: what the pipelines use for None, so a mixed batch
        # computes exactly what the separate runs would.
        kwargs["negative_prompt"] = [
            r.negative_prompt or "" for r in requests for _ in range(r.num_outputs)
        ]
    if "guidance_scale" in call_params:
        kwargs["guidance_scale"] = first.guidance_scale
    if is_video:
        kwargs["num_frames"] = first.num_frames
    return kwargs


def extra_kwargs(schema: InputSchema, extra_inputs: Mapping[str, InputValue]) -> dict[str, Any]:
    """The request's extra inputs as call arguments: only names the schema declares."""
    allowed = extra_input_names(schema) - {SCHEDULER_INPUT}
    kwargs: dict[str, Any] = {}
    for name, value in extra_inputs.items():
        if name not in allowed:
            continue  # `scheduler` is applied around the call; validate refused the rest
        kind = schema["properties"][name].get("type")
        # JSON has one kind of number: an integer parameter gets an int, a number a float.
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif kind == "number" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        kwargs[name] = value
    return kwargs


def step_hook_kwargs(
    pipe: Any,
    call_params: frozenset[str],
    steps: int,
    on_step_end: StepCallback,
    after_step: LatentsHook | None = None,
) -> dict[str, Any]:
    """The pipeline's step callback arguments reporting to `on_step_end`; {} when it has none.

    An `on_step_end` that is a `LatentsObserver` also sees the latents after each step;
    `after_step(steps_done, total, latents)` (a step checkpoint) runs before `on_step_end`, so
    a stop that `on_step_end` raises comes after the step's checkpoint. Only pipelines with
    `callback_on_step_end` call it.
    """
    observer = on_step_end if isinstance(on_step_end, LatentsObserver) else None

    def total() -> int:
        # Pipelines record the true count of timesteps (some schedulers add steps).
        return int(getattr(pipe, "_num_timesteps", None) or steps)

    def observe(step: int, latents: Any) -> None:
        if observer is not None and isinstance(latents, torch.Tensor):
            observer.observe_latents(step, total(), latents)

    if "callback_on_step_end" in call_params:
        # An exception raised here (StopDenoising) leaves the denoising loop at once.
        def on_step(
            _pipe: Any, step_index: int, _timestep: Any, tensors: dict[str, Any]
        ) -> dict[str, Any]:
            latents = tensors.get("latents")
            observe(step_index + 1, latents)
            if after_step is not None and isinstance(latents, torch.Tensor):
                after_step(step_index + 1, total(), latents)
            on_step_end(step_index + 1, total())
            return tensors

        return {"callback_on_step_end": on_step}
    if "callback" in call_params and "callback_steps" in call_params:

        def legacy(step_index: int, _timestep: Any, latents: Any) -> None:
            observe(step_index + 1, latents)
            on_step_end(step_index + 1, total())

        return {"callback": legacy, "callback_steps": 1}
    return {}  # no step hook: no progress and no early stop for this pipeline


def result_frames(
    result: Any, request: GenerationRequest, *, is_video: bool, name: str
) -> list[np.ndarray]:
    """Per output of the call, its frames (F, H, W, 3) as uint8; JobFailed on a wrong size."""
    raw = getattr(result, "frames", None) if is_video else None
    if raw is None:
        raw = result.images
    batch = np.asarray(raw)
    if batch.ndim == 4:  # images (B, H, W, 3) -> one-frame videos
        batch = batch[:, None]
    if batch.dtype != np.uint8:
        batch = to_uint8(batch)
    produced = (batch.shape[1], batch.shape[2], batch.shape[3])
    wanted = (request.num_frames, request.height, request.width)
    if produced != wanted:
        raise JobFailed(f"{name} produced frames x height x width {produced}, asked for {wanted}")
    return [np.ascontiguousarray(frames) for frames in batch]


def split_per_request(
    requests: Sequence[GenerationRequest], frames: Sequence[np.ndarray]
) -> list[list[np.ndarray]]:
    """The call's outputs, in order, handed back to the requests they belong to."""
    outputs: list[list[np.ndarray]] = []
    start = 0
    for request in requests:
        outputs.append([frames[i] for i in range(start, start + request.num_outputs)])
        start += request.num_outputs
    return outputs
