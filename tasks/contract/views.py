"""What Kiln sends back (docs/contract.md §3, §6): the job view and the events of a job."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.common.accounting import StepAccounting
from kiln.common.ledger import JobLedger
from kiln.common.states import JobState, is_terminal
from kiln.tasks.contract.job_spec import JobSpec, JobSpecRefused
from kiln.tasks.contract.schemas import JobRequest

if TYPE_CHECKING:
    from kiln.storage.job_store import JobEvent, JobRecord
    from kiln.storage.objects import ObjectStore


class JobParameters(JobRequest):
    """The effective parameters of a job as recorded (seed included)."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Progress(BaseModel):
    """Where a running job is: its stage (and step of total)."""

    model_config = ConfigDict(extra="ignore")

    stage: str = Field(
        description="loading|denoising|decoding|encoding|uploading; waiting_in_node for a queued "
        "job a node holds (WaitingProgress)"
    )
    step: int | None = None
    total: int | None = None

    def describe(self) -> str:
        """One line: `denoising 3/20`."""
        steps = f" {self.step}/{self.total}" if self.total else ""
        return f"{self.stage}{steps}"


class WaitingProgress(Progress):
    """Where a queued job a node holds waits: the node, and the jobs it starts before it."""

    node: str = Field(description="the node holding the job")
    position: int = Field(description="the jobs that node starts before it (0: next)")

    def describe(self) -> str:
        """One line: `waiting in node N (2 ahead there)`."""
        return f"waiting in node {self.node} ({self.position} ahead there)"


def progress_view(progress: dict[str, Any]) -> Progress:
    """A job's progress as stored or in its event: a held job's wait, or a running job's stage."""
    if "node" in progress and "position" in progress:
        return WaitingProgress.model_validate(progress)
    return Progress.model_validate(progress)


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
    poison: str | None = Field(
        default=None,
        description="Why Kiln marked the job poison (failed at once, never retried: "
        "group_broken_twice, out_of_memory, unusable_inputs); null otherwise.",
    )


class Metrics(BaseModel):
    """Timings and memory of a job's run; other numbers may appear beside these."""

    model_config = ConfigDict(extra="allow")

    queue_s: float | None = None
    run_s: float | None = None
    encode_s: float | None = None
    upload_s: float | None = None
    peak_memory_mb: float | None = None


class JobView(BaseModel):
    """A job as the API shows it (`GET /v1/jobs/{id}`)."""

    id: str
    status: JobState
    lane: str
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int
    progress: WaitingProgress | Progress | None = None
    outputs: list[OutputView] = Field(default_factory=list)
    error: ErrorView | None = None
    metrics: Metrics = Field(default_factory=Metrics)
    accounting: StepAccounting = Field(
        default_factory=StepAccounting,
        description="Denoising steps its attempts computed, restored from step checkpoints and "
        "computed again, and the compute seconds lost to interruptions (docs/contract.md §5b).",
    )
    ledger: JobLedger = Field(
        default_factory=JobLedger,
        description="Seconds per phase, GPU-seconds and energy over its attempts "
        "(docs/contract.md §5c).",
    )
    parameters: JobParameters
    batch_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    waiting_for: str | None = Field(
        default=None,
        description="Why a queued job cannot start yet, e.g. no live node serves its pipeline.",
    )
    queue_position: int | None = Field(
        default=None,
        ge=0,
        description="For a queued job: how many queued jobs will start before it (0: next). "
        "Set by GET /v1/jobs/{id}, the submit response and `kiln status`; null elsewhere.",
    )
    estimated_start_s: float | None = Field(
        default=None,
        ge=0,
        description="For a queued job: seconds until it is expected to start, from the recent "
        "completion rate of its pipeline; null while no rate is known or its queue is paused.",
    )


# the field of a record's output entry naming the store it was written to (`with_storage_url`)
OUTPUT_STORAGE_URL = "storage_url"


@dataclass(frozen=True)
class QueueEstimate:
    """Where a queued job stands: jobs that start before it, and when it should start (s)."""

    position: int
    estimated_start_s: float | None = None


def with_storage_url(outputs: list[dict[str, Any]], storage_url: str) -> list[dict[str, Any]]:
    """The output entries of a job's record, each naming the store it was written to."""
    return [{**output, OUTPUT_STORAGE_URL: storage_url} for output in outputs]


def output_url(output: dict[str, Any], objects: ObjectStore | None) -> str:
    """An output's URL, built from where its record says it was written.

    A `file://` store: the file's URL under that folder, whatever store the reader has (a reader
    started elsewhere would otherwise name a file under its own folder). Otherwise the reader's
    store presigns the key now (stored URLs would expire); records from before the location was
    kept have none and are presigned the same way.
    """
    key = str(output["key"])
    written_to = output.get(OUTPUT_STORAGE_URL)
    if isinstance(written_to, str) and written_to.startswith("file://"):
        from kiln.storage.local_store import LocalObjectStore, parse_file_url  # servers only

        return LocalObjectStore(parse_file_url(written_to)).url(key)
    return objects.url(key) if objects is not None else str(output.get("url", ""))


def output_view(output: dict[str, Any], objects: ObjectStore | None) -> OutputView:
    """Build an output's view; its URL from the record's store (`output_url`)."""
    key = str(output["key"])
    url = output_url(output, objects)
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
    estimate: QueueEstimate | None = None,
    spec: JobSpec | None = None,
) -> JobView:
    """Build the view of a stored record; output URLs are presigned at read time.

    `served`: the pipelines live nodes serve now; a queued job whose pipeline is not among them
    says so in `waiting_for` (it waits in its queue until such a node starts). `estimate`: the
    queued job's position and expected start (tasks.queue.positions). `spec`: the record's spec,
    when the caller has decoded it already (it is not decoded twice).
    """
    queued = estimate if record.state == JobState.QUEUED else None
    parameters = _parameters(record, spec)
    return JobView(
        id=record.id,
        status=record.state,
        lane=str(record.lane),
        created_at=record.created_at,
        started_at=record.started_at,
        finished_at=record.finished_at,
        attempts=record.attempts,
        # a finished job is past every stage: its last one (`uploading 1/1`) would be stale
        progress=(
            progress_view(record.progress)
            if record.progress and not is_terminal(record.state)
            else None
        ),
        outputs=[output_view(o, objects) for o in record.outputs],
        error=ErrorView.model_validate(record.error) if record.error else None,
        metrics=Metrics.model_validate(record.metrics or {}),
        accounting=record.accounting,
        ledger=record.ledger,
        parameters=parameters,
        batch_id=record.batch_id,
        metadata=dict(record.metadata),
        waiting_for=_waiting_for(record, parameters.pipeline, served),
        queue_position=queued.position if queued else None,
        estimated_start_s=queued.estimated_start_s if queued else None,
    )


def _parameters(record: JobRecord, spec: JobSpec | None) -> JobParameters:
    """The job's parameters: its decoded spec (given, or decoded here), shown without version."""
    try:
        spec = spec if spec is not None else JobSpec.decode(record.request)
    except JobSpecRefused:
        # a newer release's spec: shown as far as this release knows its fields, never a 500
        return JobParameters.model_validate(record.request)
    shown = {name: getattr(spec, name) for name in JobParameters.model_fields}
    return JobParameters.model_construct(spec.model_fields_set - {"version"}, **shown)


def _waiting_for(record: JobRecord, pipeline: str, served: Collection[str] | None) -> str | None:
    if served is None or record.state != JobState.QUEUED or pipeline in served:
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


class PreviewData(BaseModel):
    """The data of a `preview` event: the image inline (base64) when small, else by URL."""

    model_config = ConfigDict(extra="ignore")

    step: int
    total: int
    width: int
    height: int
    format: str = Field(description="webp|png|jpeg")
    content_type: str
    image_b64: str | None = Field(default=None, description="The image, when ≤ 64 KiB.")
    url: str | None = Field(
        default=None, description="Where a larger image is (short-lived: the job's newest)."
    )


class PreviewEvent(EventView):
    """A `preview` event as `KilnClient.events()` yields it: with its image's bytes."""

    image: bytes = Field(default=b"", exclude=True, repr=False)

    @property
    def preview(self) -> PreviewData:
        """The event's data, typed."""
        return PreviewData.model_validate(self.payload)


def event_view(event: JobEvent) -> EventView:
    """Build the view of a stored event."""
    return EventView(seq=event.seq, type=event.type, time=event.time, payload=dict(event.payload))
