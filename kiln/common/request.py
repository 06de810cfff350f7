"""A job request's fixed facts: its ranges, its lanes, its output formats, its request fields.

`kiln.tasks.contract.schemas.JobRequest` checks these ranges; the pipelines' input schemas
(gpu_worker) announce them, and the generators take any seed up to `SEED_MAX`.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal, get_args

# The schema's own ranges; pipeline limits (kiln.tasks.contract.limits) are never looser.
MIN_SIDE = 64
MAX_SIDE = 4096
SIZE_MULTIPLE = 8
MAX_STEPS = 500
MAX_FRAMES = 1024
MAX_PROMPT = 4000  # characters of a prompt or a negative prompt
MAX_GUIDANCE = 50
MAX_OUTPUTS = 16
# A caller may give any seed up to SEED_MAX: what the pipelines' generators take (a seed plus an
# output's index wraps within it). A seed drawn at submit stays below DRAWN_SEED_LIMIT, so it is
# exact in every client language's JSON numbers (JavaScript's included).
SEED_MAX = 2**63 - 1
DRAWN_SEED_LIMIT = 2**31

# Output formats, the first of each kind the default; gpu_worker encodes exactly these.
ImageFormat = Literal["png", "jpeg", "webp"]
VideoFormat = Literal["mp4", "webm", "gif"]
OutputFormat = Literal[ImageFormat, VideoFormat]
IMAGE_FORMATS: tuple[str, ...] = get_args(ImageFormat)
VIDEO_FORMATS: tuple[str, ...] = get_args(VideoFormat)


class Lane(StrEnum):
    """Priority lane of a job; each lane has its own Celery queues. The first is a job's default."""

    interactive = "interactive"
    bulk = "bulk"


# Speed modes a request may ask for (the first the default): `exact` runs the model as it is;
# `balanced` and `fast` let the denoiser skip blocks whose output barely changes between steps
# (gpu_worker/speed.py maps each onto diffusers' cache hooks). A pipeline's input schema lists
# the modes it serves under SPEED_KEY; one that lists none serves `exact` only.
SpeedMode = Literal["exact", "balanced", "fast"]
SPEED_MODES: tuple[str, ...] = get_args(SpeedMode)
DEFAULT_SPEED: SpeedMode = "exact"
SPEED_KEY = "x-kiln-speed-modes"


def declared_speed_modes(schema: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The modes an input schema announces under `SPEED_KEY`; `exact` alone where it names none."""
    announced = (schema or {}).get(SPEED_KEY)
    if not isinstance(announced, list):
        return (DEFAULT_SPEED,)
    return tuple(mode for mode in SPEED_MODES if mode in announced) or (DEFAULT_SPEED,)


# A pipeline's own inputs: a JSON Schema object (its properties under the pipeline's names), and
# one input's value as JSON carries it (image references are strings).
InputSchema = dict[str, Any]
InputValue = bool | int | float | str | None

# A pipeline's input schema marks its properties with these keys: `x-kiln-field` names the Kiln
# request field a property is, `x-kiln-image` an image reference (an upload or a URL).
FIELD_KEY = "x-kiln-field"
IMAGE_KEY = "x-kiln-image"
# A node marks the schema it announces with the request fields the pipeline honours (its
# `supported_fields()`, sorted), which the console turns into form fields.
FIELDS_KEY = "x-kiln-fields"
# ... and with whether its denoising loop takes step checkpoints and resumes from them: only such
# a pipeline's jobs get a checkpoint plan (and so run unbatched); the others batch as before.
CHECKPOINTS_KEY = "x-kiln-checkpoints"


def pipeline_takes_checkpoints(schemas: Mapping[str, Mapping[str, Any]], pipeline: str) -> bool:
    """Whether the schema announced for `pipeline` says its loop takes step checkpoints."""
    return (schemas.get(pipeline) or {}).get(CHECKPOINTS_KEY) is True


# Pipeline argument names (and the fields' own names) that are request fields: a request's
# `inputs` may give them instead of the top-level field, and a pipeline's schema marks them.
REQUEST_FIELDS: dict[str, str] = {
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "width": "width",
    "height": "height",
    "num_inference_steps": "steps",
    "steps": "steps",
    "guidance_scale": "guidance_scale",
    "num_frames": "num_frames",
    "num_images_per_prompt": "num_outputs",
    "num_videos_per_prompt": "num_outputs",
    "num_outputs": "num_outputs",
    "seed": "seed",
}
