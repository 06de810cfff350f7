"""The job request (docs/contract.md §1): its model and webhook spec.

Its ranges, output formats and lanes are `kiln.common.request`'s (gpu_worker announces the same
ranges); what Kiln sends back (the job view, events) is `contract.views`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kiln.common.previews import (
    DEFAULT_PREVIEW_FORMAT,
    DEFAULT_PREVIEW_SIDE,
    MAX_PREVIEW_SIDE,
    MIN_PREVIEW_SIDE,
    PREVIEW_FORMATS,
    PreviewFormat,
)
from kiln.common.request import (
    DEFAULT_SPEED,
    IMAGE_FORMATS,
    MAX_FRAMES,
    MAX_GUIDANCE,
    MAX_OUTPUTS,
    MAX_PROMPT,
    MAX_SIDE,
    MAX_STEPS,
    MIN_SIDE,
    SEED_MAX,
    SIZE_MULTIPLE,
    VIDEO_FORMATS,
    Lane,
    OutputFormat,
    SpeedMode,
)
from kiln.tasks.contract.inputs import lift_request_fields
from kiln.tasks.contract.loras import MAX_LORAS, LoraSpec, check_unique

METADATA_MAX_ITEMS = 16
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512

PipelineName = Annotated[
    str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]
# numbers are strict: JSON true is not 1, "512" is not 512 (pydantic would convert both)
Dimension = Annotated[int, Field(strict=True, ge=MIN_SIDE, le=MAX_SIDE, multiple_of=SIZE_MULTIPLE)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=METADATA_KEY_MAX)]
MetadataValue = Annotated[str, StringConstraints(max_length=METADATA_VALUE_MAX)]
INPUTS_MAX_ITEMS = 32
INPUT_VALUE_MAX = 4096
InputName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
]
# One input's value: a JSON scalar (image references are strings). Strict members: "1" stays a
# string and true a boolean, so the pipeline's schema judges the value as sent.
InputScalar = (
    StrictBool
    | StrictInt
    | Annotated[float, Field(allow_inf_nan=False)]
    | Annotated[str, StringConstraints(max_length=INPUT_VALUE_MAX)]
    | None
)


def formats_for(num_frames: int) -> tuple[str, ...]:
    """The output formats of a request with `num_frames` frames; the first is the default."""
    return IMAGE_FORMATS if num_frames == 1 else VIDEO_FORMATS


class WebhookEvent(StrEnum):
    """Job events a webhook can subscribe to."""

    started = "started"
    progress = "progress"
    completed = "completed"
    preview = "preview"
    dead = "dead"  # the job failed for good: its dead letter is written (docs/contract.md §5a)
    paused = "paused"  # the job was paused (queued, or its run stopped at a step: §4a)
    resumed = "resumed"  # a paused job was resumed: queued again


class WebhookSpec(BaseModel):
    """Where to send signed callbacks for a job, and for which events."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        min_length=1,
        max_length=2048,
        description="https URL (http only where the server allows it); checked for SSRF at submit.",
    )
    events: list[WebhookEvent] = Field(
        default_factory=lambda: [WebhookEvent.completed],
        min_length=1,
        max_length=len(WebhookEvent),
        description="Subset of started, progress (throttled), completed, preview (opt-in: "
        "each preview event, its image inline or by URL), dead (a failure for good, beside "
        "its completed), paused, resumed.",
    )

    @field_validator("events")
    @classmethod
    def _no_duplicate_events(cls, events: list[WebhookEvent]) -> list[WebhookEvent]:
        if len(set(events)) != len(events):
            raise ValueError("events must not repeat")
        return events


class PreviewRequest(BaseModel):
    """Previews while the job denoises (`preview` events): one every `every_steps` steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_steps: int = Field(
        default=1, strict=True, ge=1, le=MAX_STEPS, description="A preview every N steps."
    )
    max_side: int = Field(
        default=DEFAULT_PREVIEW_SIDE,
        strict=True,
        ge=MIN_PREVIEW_SIDE,
        le=MAX_PREVIEW_SIDE,
        description="Longer side of a preview, in pixels, at most (never above the output's).",
    )
    format: PreviewFormat = Field(
        default=DEFAULT_PREVIEW_FORMAT, description="|".join(PREVIEW_FORMATS)
    )


class CheckpointRequest(BaseModel):
    """This job's step checkpoints: one after every `every_steps` steps or `every_seconds` seconds.

    Absent, the node's default applies (docs/contract.md §1): a video run checkpoints every
    `KILN_CHECKPOINT_EVERY_S`, an image run never. Given, the run checkpoints at this cadence,
    image or video, on any pipeline that announces step checkpoints (`x-kiln-checkpoints`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    every_steps: int | None = Field(
        default=None, strict=True, ge=1, le=MAX_STEPS, description="A checkpoint every N steps."
    )
    every_seconds: float | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=86400,
        allow_inf_nan=False,
        description="A checkpoint after the first step that ends S seconds after the last one.",
    )

    @model_validator(mode="after")
    def _one_cadence(self) -> CheckpointRequest:
        if (self.every_steps is None) == (self.every_seconds is None):
            raise ValueError("give exactly one of every_steps or every_seconds")
        return self


class JobRequest(BaseModel):
    """A generation request (`POST /v1/jobs`); every field is range-checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: PipelineName = Field(default="default", description="Name of a served pipeline.")
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT)
    negative_prompt: str | None = Field(default=None, max_length=MAX_PROMPT)
    width: Dimension = 512
    height: Dimension = 512
    num_frames: int = Field(
        default=1, strict=True, ge=1, le=MAX_FRAMES, description="1 = image, >1 = video."
    )
    fps: int = Field(
        default=8, strict=True, ge=1, le=120, description="Frames per second of a video."
    )
    steps: int = Field(default=25, strict=True, ge=1, le=MAX_STEPS)
    guidance_scale: float = Field(
        default=7.0, strict=True, ge=0, le=MAX_GUIDANCE, allow_inf_nan=False
    )
    seed: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=SEED_MAX,
        description="Drawn at submit when absent; recorded.",
    )
    num_outputs: int = Field(default=1, strict=True, ge=1, le=MAX_OUTPUTS)
    output_format: OutputFormat | None = Field(
        default=None,
        validate_default=True,
        description=f"{'|'.join(IMAGE_FORMATS)} for images, {'|'.join(VIDEO_FORMATS)} for video; "
        f"default {IMAGE_FORMATS[0]} or {VIDEO_FORMATS[0]}.",
    )
    priority: Lane = Lane.interactive
    webhook: WebhookSpec | None = None
    start_by: float | None = Field(
        default=None,
        strict=True,
        gt=0,
        allow_inf_nan=False,
        description="Unix time (s): a job not started by then expires without running.",
    )
    max_run_seconds: float | None = Field(
        default=None,
        strict=True,
        gt=0,
        le=86400,
        allow_inf_nan=False,
        description="Deadline of one run.",
    )
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict,
        max_length=METADATA_MAX_ITEMS,
        description=f"Small str→str map echoed back (≤{METADATA_MAX_ITEMS} keys, "
        f"key ≤{METADATA_KEY_MAX}, value ≤{METADATA_VALUE_MAX} chars).",
    )
    inputs: dict[InputName, InputScalar] = Field(
        default_factory=dict,
        max_length=INPUTS_MAX_ITEMS,
        description="The pipeline's own inputs by name (GET /v1/pipelines/{name} lists them), "
        "e.g. scheduler or strength; request fields under a pipeline's name "
        "(num_inference_steps) move to their top-level field, which must then be absent.",
    )
    preview: PreviewRequest | None = Field(
        default=None,
        description="Previews while denoising, as `preview` events (and webhooks that ask for "
        "them); off when absent.",
    )
    checkpoint: CheckpointRequest | None = Field(
        default=None,
        description="Step checkpoints of the run, so an interrupted job resumes where it was "
        "(§1): {every_steps: N} or {every_seconds: S}; absent, a video checkpoints every "
        "KILN_CHECKPOINT_EVERY_S and an image never.",
    )
    loras: list[LoraSpec] = Field(
        default_factory=list,
        max_length=MAX_LORAS,
        description=f"LoRA adapters to apply (≤{MAX_LORAS}, each named once), from those "
        "GET /v1/pipelines/{name} lists; jobs batch together only with equal adapters.",
    )
    speed: SpeedMode = Field(
        default=DEFAULT_SPEED,
        description="exact runs the model as it is; balanced and fast skip denoiser blocks "
        "whose output barely changes between steps (faster, slightly different pixels). "
        "GET /v1/pipelines/{name} lists the modes a pipeline serves (inputs x-kiln-speed-modes); "
        "one that serves exact only refuses the others. Jobs batch together only in one mode.",
    )

    @model_validator(mode="before")
    @classmethod
    def _lift_request_fields(cls, data: Any) -> Any:
        # `inputs: {num_inference_steps: 10}` is `steps: 10`: one place for each value.
        if isinstance(data, dict):
            return lift_request_fields(data, frozenset(cls.model_fields))
        return data

    @field_validator("loras")
    @classmethod
    def _unique_loras(cls, loras: list[LoraSpec]) -> list[LoraSpec]:
        check_unique(loras)
        return loras

    @field_validator("output_format")
    @classmethod
    def _format_fits_frames(cls, value: str | None, info: ValidationInfo) -> str:
        if "num_frames" not in info.data:  # num_frames itself is invalid: one error is enough
            return value or IMAGE_FORMATS[0]
        frames = info.data["num_frames"]
        allowed = formats_for(frames)
        if value is None:
            return allowed[0]
        if value not in allowed:
            kind = "an image (num_frames=1)" if frames == 1 else "a video (num_frames>1)"
            raise ValueError(f"{value!r} is not a format for {kind}; use one of {list(allowed)}")
        return value

    @property
    def is_video(self) -> bool:
        """True when the request asks for more than one frame."""
        return self.num_frames > 1

    def to_record(self) -> dict[str, Any]:
        """The JSON-safe dict stored as `JobRecord.request`."""
        record = self.model_dump(mode="json")
        if not record["inputs"]:
            # Requests without inputs keep the fingerprint they had before `inputs` existed.
            del record["inputs"]
        if not record["loras"]:
            del record["loras"]  # likewise for requests without adapters
        if record["preview"] is None:
            del record["preview"]  # and for requests without previews
        if record["checkpoint"] is None:
            del record["checkpoint"]  # and for requests on the node's cadence
        if record["speed"] == DEFAULT_SPEED:
            del record["speed"]  # and for requests in the default mode
        return record
