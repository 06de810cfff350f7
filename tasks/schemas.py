"""The job contract (docs/contract.md §1–§3): the request model, the job view, events."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

if TYPE_CHECKING:
    from storage.objects import ObjectStore
    from storage.status import JobEvent, JobRecord

IMAGE_FORMATS: tuple[str, ...] = ("png", "jpeg", "webp")
VIDEO_FORMATS: tuple[str, ...] = ("mp4", "webm", "gif")
OutputFormat = Literal["png", "jpeg", "webp", "mp4", "webm", "gif"]
METADATA_MAX_ITEMS = 16
METADATA_KEY_MAX = 64
METADATA_VALUE_MAX = 512
SEED_MAX = 2**63 - 1

PipelineName = Annotated[
    str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
]
Dimension = Annotated[int, Field(ge=64, le=4096, multiple_of=8)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=METADATA_KEY_MAX)]
MetadataValue = Annotated[str, StringConstraints(max_length=METADATA_VALUE_MAX)]


class Lane(StrEnum):
    """Priority lane of a job; each lane has its own Celery queues."""

    interactive = "interactive"
    bulk = "bulk"


class WebhookEvent(StrEnum):
    """Job events a webhook can subscribe to."""

    started = "started"
    progress = "progress"
    completed = "completed"


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
        max_length=3,
        description="Subset of started, progress (throttled), completed.",
    )

    @field_validator("events")
    @classmethod
    def _no_duplicate_events(cls, events: list[WebhookEvent]) -> list[WebhookEvent]:
        if len(set(events)) != len(events):
            raise ValueError("events must not repeat")
        return events


class JobRequest(BaseModel):
    """A generation request (`POST /v1/jobs`); every field is range-checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: PipelineName = Field(default="default", description="Name of a served pipeline.")
    prompt: str = Field(min_length=1, max_length=4000)
    negative_prompt: str | None = Field(default=None, max_length=4000)
    width: Dimension = 512
    height: Dimension = 512
    num_frames: int = Field(default=1, ge=1, le=1024, description="1 = image, >1 = video.")
    fps: int = Field(default=8, ge=1, le=120, description="Frames per second of a video.")
    steps: int = Field(default=25, ge=1, le=500)
    guidance_scale: float = Field(default=7.0, ge=0, le=50, allow_inf_nan=False)
    seed: int | None = Field(
        default=None, ge=0, le=SEED_MAX, description="Drawn at submit when absent; recorded."
    )
    num_outputs: int = Field(default=1, ge=1, le=16)
    output_format: OutputFormat | None = Field(
        default=None,
        validate_default=True,
        description="png|jpeg|webp for images, mp4|webm|gif for video; default png or mp4.",
    )
    priority: Lane = Lane.interactive
    webhook: WebhookSpec | None = None
    start_by: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Unix time (s): a job not started by then expires without running.",
    )
    max_run_seconds: float | None = Field(
        default=None, gt=0, le=86400, allow_inf_nan=False, description="Deadline of one run."
    )
    metadata: dict[MetadataKey, MetadataValue] = Field(
        default_factory=dict,
        max_length=METADATA_MAX_ITEMS,
        description="Small str→str map echoed back (≤16 keys, key ≤64, value ≤512 chars).",
    )

    @field_validator("output_format")
    @classmethod
    def _format_fits_frames(cls, value: str | None, info: ValidationInfo) -> str:
        if "num_frames" not in info.data:  # num_frames itself is invalid: one error is enough
            return value or IMAGE_FORMATS[0]
        frames = info.data["num_frames"]
        allowed = IMAGE_FORMATS if frames == 1 else VIDEO_FORMATS
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
        return self.model_dump(mode="json")


def fingerprint(request: JobRequest) -> str:
    """Stable sha256 of the request's canonical JSON (defaults filled, keys sorted)."""
    canonical = json.dumps(
        request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


class JobParameters(JobRequest):
    """The effective parameters of a job as recorded (seed included)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Progress(BaseModel):
    """Where a running job is."""

    model_config = ConfigDict(extra="ignore")

    stage: str = Field(description="queued|loading|denoising|decoding|encoding|uploading")
    step: int | None = None
    total: int | None = None


class OutputView(BaseModel):
    """One stored output; `url` is presigned when the view is built."""

    url: str
    key: str
    content_type: str
    bytes: int
    sha256: str
    width: int | None = None
    height: int | None = None
    frames: int | None = None


class ErrorView(BaseModel):
    """Why a job failed."""

    model_config = ConfigDict(extra="ignore")

    type: str
    message: str
    retryable: bool = False


class Metrics(BaseModel):
    """Timings and memory of a job's run; other numbers may appear beside these."""

    model_config = ConfigDict(extra="allow")

    queue_s: float | None = None
    run_s: float | None = None
    encode_s: float | None = None
    upload_s: float | None = None
    peak_memory_mb: float | None = None


JobStatus = Literal["queued", "running", "succeeded", "failed", "canceled", "expired"]


class JobView(BaseModel):
    """A job as the API shows it (`GET /v1/jobs/{id}`)."""

    id: str
    status: JobStatus
    lane: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int
    progress: Progress | None = None
    outputs: list[OutputView] = Field(default_factory=list)
    error: ErrorView | None = None
    metrics: Metrics = Field(default_factory=Metrics)
    parameters: JobParameters
    batch_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    waiting_for: str | None = Field(
        default=None,
        description="Why a queued job cannot start yet, e.g. no live node serves its pipeline.",
    )


def output_view(output: dict[str, Any], objects: ObjectStore | None) -> OutputView:
    """Build an output's view, presigning its URL now (stored URLs would expire)."""
    key = str(output["key"])
    url = objects.url(key) if objects is not None else str(output.get("url", ""))
    return OutputView(
        url=url,
        key=key,
        content_type=str(output.get("content_type", "application/octet-stream")),
        bytes=int(output.get("bytes", output.get("size", 0))),
        sha256=str(output.get("sha256", "")),
        width=output.get("width"),
        height=output.get("height"),
        frames=output.get("frames"),
    )


def job_view(
    record: JobRecord,
    objects: ObjectStore | None = None,
    served: Collection[str] | None = None,
) -> JobView:
    """Build the view of a stored record; output URLs are presigned at read time.

    `served`: the pipelines live nodes serve now; a queued job whose pipeline is not among them
    says so in `waiting_for` (it waits in its queue until such a node starts).
    """
    return JobView(
        id=record.id,
        status=str(record.state),  # type: ignore[arg-type]
        lane=str(record.lane),
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        attempts=record.attempts,
        progress=Progress.model_validate(record.progress) if record.progress else None,
        outputs=[output_view(o, objects) for o in record.outputs],
        error=ErrorView.model_validate(record.error) if record.error else None,
        metrics=Metrics.model_validate(record.metrics or {}),
        parameters=JobParameters.model_validate(record.request),
        batch_id=record.batch_id,
        metadata=dict(record.metadata),
        waiting_for=_waiting_for(record, served),
    )


def _waiting_for(record: JobRecord, served: Collection[str] | None) -> str | None:
    pipeline = str(record.request.get("pipeline", ""))
    if served is None or record.state != "queued" or pipeline in served:
        return None
    serving = ", ".join(sorted(served)) or "none"
    return (
        f"no live node serves pipeline {pipeline!r} (live nodes serve: {serving}); "
        "the job waits in its queue until one does"
    )


class EventView(BaseModel):
    """One event of a job's stream (the `data` of a server-sent event)."""

    seq: int
    type: str
    time: float
    payload: dict[str, Any] = Field(default_factory=dict)


def event_view(event: JobEvent) -> EventView:
    """Build the view of a stored event."""
    return EventView(seq=event.seq, type=event.type, time=event.time, payload=dict(event.payload))
