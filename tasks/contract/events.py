"""A job's events as one typed union (docs/contract.md §6): what writers build, readers parse.

Every entry of a job's event stream is `{seq, type, time, payload}`; `type` says what the payload
holds. `Event` is the discriminated union of every kind: the state changes (`queued`, `running`,
`succeeded`, `failed`, `canceled`, `expired`, `paused`, and a paused job's `resumed`), `progress`,
`preview` and `output`. The node builds the payloads it writes from these models and hands them to
its `EventSink` (tasks/webhooks/event_sink.py: every process's one way from an event to its
listeners and webhooks), so a malformed event is refused where it is made, not where it is read; the
state changes' payloads (kiln/common/job_events.py, below storage, which writes them) are built by
storage's transitions from the same models. Readers (the SSE route, webhooks, the client) parse a
stored entry with `parse_event` and hand it on with `event_json`, which gives back the entry as
written: the wire format is the stream's.

Payloads keep fields they do not name (`extra="allow"`), so an entry written by a newer node
passes through an older reader unchanged. A new kind (a checkpoint) is one more member here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from kiln.common.job_events import (
    CanceledData,
    ErrorData,
    ExpiredData,
    FailedData,
    PausedData,
    Payload,
    PreemptedData,
    ProgressData,
    QueuedData,
    ResumedData,
    RunningData,
    SucceededData,
)
from kiln.tasks.contract.views import PreviewData, Progress, WaitingProgress

# the union and every payload, from this one module (the state changes' live in kiln/common)
__all__ = [
    "EVENTS",
    "EVENT_TYPES",
    "CanceledData",
    "CanceledEvent",
    "ErrorData",
    "Event",
    "ExpiredData",
    "ExpiredEvent",
    "FailedData",
    "FailedEvent",
    "NodePayload",
    "OutputEvent",
    "OutputPayload",
    "PausedData",
    "PausedEvent",
    "Payload",
    "PreemptedData",
    "PreemptedEvent",
    "PreviewPayload",
    "ProgressData",
    "ProgressEvent",
    "QueuedData",
    "QueuedEvent",
    "ResumedData",
    "ResumedEvent",
    "RunningData",
    "RunningEvent",
    "StepPreviewEvent",
    "StoredEvent",
    "SucceededData",
    "SucceededEvent",
    "event_json",
    "parse_event",
    "preview_of",
    "progress_view",
]

# `int | float` where a writer may put either: a payload round-trips as written (1 stays 1)
Number = int | float


class PreviewPayload(PreviewData, Payload):
    """`preview`: the job's first output as it looks after `step`, inline or by URL (not both)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    kind = "preview"

    @model_validator(mode="after")
    def _inline_or_url(self) -> PreviewPayload:
        if (self.image_b64 is None) == (self.url is None):
            raise ValueError("a preview carries its image inline (image_b64) or by url: one")
        return self


class OutputPayload(Payload):
    """`output`: one output stored and verified, before the job's end (the record's entry)."""

    kind = "output"
    index: int
    url: str
    key: str
    sha256: str
    bytes: int
    content_type: str
    width: int | None = None
    height: int | None = None
    frames: int | None = None


class _Entry(BaseModel):
    """What every event has: its place in the job's stream and when it happened."""

    model_config = ConfigDict(frozen=True)

    seq: int = Field(ge=1)
    time: Number


class QueuedEvent(_Entry):
    """A `queued` entry."""

    type: Literal["queued"]
    payload: QueuedData


class PreemptedEvent(_Entry):
    """A `preempted` entry (after the `queued` one of the same change)."""

    type: Literal["preempted"]
    payload: PreemptedData


class RunningEvent(_Entry):
    """A `running` entry."""

    type: Literal["running"]
    payload: RunningData


class ProgressEvent(_Entry):
    """A `progress` entry."""

    type: Literal["progress"]
    payload: ProgressData


class StepPreviewEvent(_Entry):
    """A `preview` entry (the client's `PreviewEvent` adds the image's bytes to it)."""

    type: Literal["preview"]
    payload: PreviewPayload


class OutputEvent(_Entry):
    """An `output` entry."""

    type: Literal["output"]
    payload: OutputPayload


class SucceededEvent(_Entry):
    """A `succeeded` entry."""

    type: Literal["succeeded"]
    payload: SucceededData


class FailedEvent(_Entry):
    """A `failed` entry."""

    type: Literal["failed"]
    payload: FailedData


class CanceledEvent(_Entry):
    """A `canceled` entry."""

    type: Literal["canceled"]
    payload: CanceledData


class ExpiredEvent(_Entry):
    """An `expired` entry."""

    type: Literal["expired"]
    payload: ExpiredData


class PausedEvent(_Entry):
    """A `paused` entry: the job holds no GPU and no place in line (its checkpoints are kept)."""

    type: Literal["paused"]
    payload: PausedData


class ResumedEvent(_Entry):
    """A `resumed` entry: a paused job is `queued` again, at the back of its lane."""

    type: Literal["resumed"]
    payload: ResumedData


Event = Annotated[
    QueuedEvent
    | PreemptedEvent
    | RunningEvent
    | ProgressEvent
    | StepPreviewEvent
    | OutputEvent
    | SucceededEvent
    | FailedEvent
    | CanceledEvent
    | ExpiredEvent
    | PausedEvent
    | ResumedEvent,
    Field(discriminator="type"),
]
EVENTS: TypeAdapter[Event] = TypeAdapter(Event)


def progress_view(progress: ProgressData) -> Progress:
    """The job view's `progress` of a `progress` event: a held job's wait, or a running stage."""
    fields = progress.wire()
    if progress.node is not None and progress.position is not None:
        return WaitingProgress.model_validate(fields)
    return Progress.model_validate(fields)


# what a node writes itself; the state changes are the transitions' (storage/transitions.py)
NodePayload = ProgressData | PreviewPayload | OutputPayload
# every kind, by its `type`
EVENT_TYPES: tuple[str, ...] = tuple(
    get_args(member.model_fields["type"].annotation)[0] for member in get_args(get_args(Event)[0])
)


class StoredEvent(Protocol):
    """An entry as read from a job's stream (storage's `JobEvent`, the client's `EventView`)."""

    @property
    def seq(self) -> int: ...  # noqa: D102
    @property
    def type(self) -> str: ...  # noqa: D102
    @property
    def time(self) -> float: ...  # noqa: D102
    @property
    def payload(self) -> dict[str, Any]: ...  # noqa: D102


def parse_event(stored: StoredEvent) -> Event:
    """The typed event of a stored entry; pydantic's ValidationError when it is no event."""
    return EVENTS.validate_python(
        {"seq": stored.seq, "type": stored.type, "time": stored.time, "payload": stored.payload}
    )


def event_json(event: Event) -> dict[str, Any]:
    """The event as the stream and the wire carry it: `{seq, type, time, payload}`, as written."""
    return {
        "seq": event.seq,
        "type": event.type,
        "time": event.time,
        "payload": event.payload.wire(),
    }


def preview_of(stored: StoredEvent) -> PreviewPayload:
    """The typed payload of a stored `preview` entry (ValueError for another kind)."""
    event = parse_event(stored)
    if not isinstance(event, StepPreviewEvent):
        raise ValueError(f"event {stored.seq} is a {stored.type} event, not a preview")
    return event.payload
