"""The input schema of a diffusers pipeline, derived from its `__call__` signature.

No per-model code: every parameter of `__call__` is looked at once, and only an allow-list of
kinds becomes an input.

- Kiln's request fields under the pipeline's names (`prompt`, `negative_prompt`, `width`,
  `height`, `num_inference_steps`, `guidance_scale`, `num_frames`, `num_images_per_prompt` /
  `num_videos_per_prompt`, and Kiln's own `seed`), marked `x-kiln-field`, with the pipeline's
  limits as their ranges.
- JSON-safe scalars (bool, int, float, str, a `Literal`; optional or not): extra inputs with the
  call's default. Numbers get a range: a known one for well-known names (`strength`, `eta`,
  `guidance_rescale`: 0 to 1; any `*guidance_scale*`: 0 to 50; `clip_skip` below the text encoder's
  depth; `max_sequence_length` up to its default), else 0 to four times a positive default (as the
  derived limits allow steps), else at least 0.
- Images (`image`, `mask_image`, `control_image`, …: any parameter typed with PIL images):
  image references, strings; `image` and `mask_image` are required where the call has them.
- `scheduler`: Kiln's own extra input, the class names of the pipeline's compatible schedulers
  (`pipe.scheduler.compatibles`) that can be built from its scheduler's config here.

Everything else is left out: callbacks, generators, tensors and latents, embeddings, keyword
dictionaries, explicit timesteps or sigmas, `output_type`, `return_dict`, and parameters whose
names are Kiln request fields of another meaning (`fps` is the encoder's). A few parameters apply
only when the pipeline has a component (`ip_adapter_image` needs an image encoder,
`guidance_scale_2` a second transformer); without it they are left out too.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from kiln.common.limits import DeclaredLimits
from kiln.common.request import (
    FIELD_KEY,
    IMAGE_KEY,
    MAX_GUIDANCE,
    MAX_OUTPUTS,
    MAX_PROMPT,
    MIN_SIDE,
    REQUEST_FIELDS,
    SEED_MAX,
    InputSchema,
)
from kiln.gpu_worker.pipelines.diffusers_schedulers import SCHEDULER_INPUT
from kiln.gpu_worker.pipelines.image_pipelines import REQUIRED_IMAGES
from kiln.gpu_worker.pipelines.signature_kinds import json_kind, json_scalar

DEFAULT_FACTOR = 4  # an unknown number may go up to four times its default

DENIED = frozenset(
    {
        "self",
        "generator",
        "latents",
        "output_type",
        "return_dict",
        "callback",
        "callback_steps",
        "callback_on_step_end",
        "callback_on_step_end_tensor_inputs",
        "cross_attention_kwargs",
        "attention_kwargs",
        "joint_attention_kwargs",
        "added_cond_kwargs",
        "timesteps",
        "sigmas",
        "fps",  # the request's fps is the encoder's frame rate, not a conditioning value
        "pipeline",
        "priority",
        "metadata",
        "webhook",
        "output_format",
        "start_by",
        "max_run_seconds",
        "inputs",
        SCHEDULER_INPUT,
    }
)
DENIED_SUFFIXES = ("_embeds", "_latents", "_kwargs", "_callback")
KNOWN_RANGES: dict[str, tuple[float, float]] = {
    "strength": (0.0, 1.0),
    "eta": (0.0, 1.0),
    "guidance_rescale": (0.0, 1.0),
    "noise_aug_strength": (0.0, 1.0),
    "control_guidance_start": (0.0, 1.0),
    "control_guidance_end": (0.0, 1.0),
}
# Parameters that apply only when the pipeline has this component (not None).
NEEDS_COMPONENT = {
    "ip_adapter_image": "image_encoder",
    "guidance_scale_2": "transformer_2",
}


def derive_input_schema(
    pipe: Any,
    parameters: Mapping[str, inspect.Parameter],
    limits: DeclaredLimits,
    *,
    title: str,
    is_video: bool,
    schedulers: list[str],
) -> InputSchema:
    """The JSON Schema of what `pipe` takes (see the module docstring for the rules)."""
    properties = _call_properties(pipe, parameters, limits, is_video=is_video)
    properties.update(_kiln_properties(schedulers))
    schema: InputSchema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": title,
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "x-kiln-pipeline-class": type(pipe).__name__,
    }
    required = [name for name in REQUIRED_IMAGES if IMAGE_KEY in properties.get(name, {})]
    if required:  # an img2img, inpaint or image-to-video pipeline cannot run without them
        schema["required"] = required
    return schema


def _call_properties(
    pipe: Any,
    parameters: Mapping[str, inspect.Parameter],
    limits: DeclaredLimits,
    *,
    is_video: bool,
) -> dict[str, Any]:
    """The `__call__` parameters that become inputs: request fields first, else allowed extras."""
    properties: dict[str, Any] = {}
    for name, parameter in parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        prop = _request_field(name, limits, is_video=is_video)
        if prop is None and _allowed(pipe, name):
            prop = _extra_input(pipe, name, parameter)
        if prop is not None:
            properties[name] = prop
    return properties


def _kiln_properties(schedulers: list[str]) -> dict[str, Any]:
    """Inputs Kiln adds to every pipeline's: the seed, and the scheduler where there is a choice."""
    properties: dict[str, Any] = {
        "seed": {
            "type": "integer",
            "minimum": 0,
            "maximum": SEED_MAX,
            FIELD_KEY: "seed",
            "description": "Seed of the first output; output i uses seed + i.",
        }
    }
    if schedulers:
        properties[SCHEDULER_INPUT] = {
            "type": "string",
            "enum": schedulers,
            "default": schedulers[0],
            "description": "The denoising scheduler, built from the pipeline's own config.",
        }
    return properties


def _request_field(name: str, limits: DeclaredLimits, *, is_video: bool) -> dict[str, Any] | None:
    multiple = limits.get("size_multiple", 8)
    fields: dict[str, dict[str, Any]] = {
        "prompt": {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT},
        "negative_prompt": {"type": "string", "maxLength": MAX_PROMPT},
        "width": _side(limits.get("max_width"), multiple),
        "height": _side(limits.get("max_height"), multiple),
        "num_inference_steps": _bounded("integer", 1, limits.get("max_steps")),
        "guidance_scale": _bounded("number", 0, MAX_GUIDANCE),
        "num_images_per_prompt": _bounded("integer", 1, MAX_OUTPUTS),
        "num_videos_per_prompt": _bounded("integer", 1, MAX_OUTPUTS),
    }
    if is_video:
        frames = _bounded("integer", limits.get("min_frames", 1), limits.get("max_frames"))
        step = limits.get("frame_step", 1)
        if step > 1:
            frames["description"] = f"{step}k+1 frames"
        fields["num_frames"] = frames
    prop = fields.get(name)
    if prop is None:
        return None
    return {**prop, FIELD_KEY: REQUEST_FIELDS[name]}


def _side(maximum: int | None, multiple: int) -> dict[str, Any]:
    smallest = -(-MIN_SIDE // multiple) * multiple  # the schema's smallest side, on the grid
    return {**_bounded("integer", smallest, maximum), "multipleOf": multiple}


def _bounded(kind: str, minimum: float | None, maximum: float | None) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": kind}
    if minimum is not None:
        prop["minimum"] = minimum
    if maximum is not None:
        prop["maximum"] = maximum
    return prop


def _allowed(pipe: Any, name: str) -> bool:
    if name in DENIED or name.endswith(DENIED_SUFFIXES):
        return False
    component = NEEDS_COMPONENT.get(name)
    return component is None or getattr(pipe, component, None) is not None


def _extra_input(pipe: Any, name: str, parameter: inspect.Parameter) -> dict[str, Any] | None:
    default = None if parameter.default is inspect.Parameter.empty else parameter.default
    kind = json_kind(parameter.annotation, default)
    if kind is None:
        return None
    if kind == "image":
        return {
            "type": "string",
            "minLength": 1,
            "maxLength": 2048,
            IMAGE_KEY: True,
            "description": "An image: upload:<upload_id> (POST /v1/uploads) or an https:// URL.",
        }
    if isinstance(kind, list):
        prop: dict[str, Any] = {"enum": kind}
    else:
        prop = {"type": kind}
        if kind in ("integer", "number"):
            prop.update(_number_range(pipe, name, default))
        elif kind == "string":
            prop["maxLength"] = MAX_PROMPT
    if default is not None and json_scalar(default):
        prop["default"] = default
    return prop


def _number_range(pipe: Any, name: str, default: object) -> dict[str, Any]:
    if name in KNOWN_RANGES:
        low, high = KNOWN_RANGES[name]
        return {"minimum": low, "maximum": high}
    if "guidance_scale" in name:
        return {"minimum": 0, "maximum": MAX_GUIDANCE}
    if name == "clip_skip":
        config = getattr(getattr(pipe, "text_encoder", None), "config", None)
        layers = getattr(config, "num_hidden_layers", None)
        if isinstance(layers, int):  # skipping every layer would leave no text features
            return {"minimum": 0, "maximum": max(0, layers - 1)}
        return {"minimum": 0}
    positive = isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0
    if name == "max_sequence_length" and positive:
        return {"minimum": 1, "maximum": default}
    if positive:
        assert isinstance(default, (int, float))
        return {"minimum": 0, "maximum": DEFAULT_FACTOR * default}
    return {"minimum": 0}
