"""What one webhook message says: the job event it reports, its body, and its signature.

A message reports one job event, pinned when it is queued. Its body is the job's view as of that
event (docs/contract.md §7), built at the first attempt; every retry sends the same bytes, and
only `webhook-timestamp`, and so the signature, is new per attempt (Standard Webhooks).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from standardwebhooks import Webhook

from kiln.common.states import TERMINAL_STATES, JobState, is_terminal
from kiln.storage.job_store import JobEvent, JobRecord
from kiln.storage.objects import ObjectStore
from kiln.storage.queries import QueryOps
from kiln.tasks.contract.events import (
    ProgressEvent,
    RunningEvent,
    StepPreviewEvent,
    parse_event,
    preview_of,
    progress_view,
)
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import WebhookEvent
from kiln.tasks.contract.views import JobView, Metrics, Progress, job_view

USER_AGENT = "Kiln-Webhooks/1"
# the job event types each webhook event reports
EVENT_TYPES: dict[str, frozenset[str]] = {
    WebhookEvent.started: frozenset({JobState.RUNNING}),
    WebhookEvent.progress: frozenset({"progress"}),
    WebhookEvent.completed: frozenset(TERMINAL_STATES),
    WebhookEvent.preview: frozenset({"preview"}),
    WebhookEvent.dead: frozenset({JobState.FAILED}),
    WebhookEvent.paused: frozenset({JobState.PAUSED}),
    WebhookEvent.resumed: frozenset({"resumed"}),
}
# the status a pause's or a resume's message reports, whatever the job has become since
_PAUSE_STATUS = {JobState.PAUSED.value: JobState.PAUSED, "resumed": JobState.QUEUED}
# events looked through for the one a webhook reports: it is the newest of its kind when the
# webhook is queued right after the write, so a short look back is plenty
EVENT_LOOKBACK = 32


def find_event(store: QueryOps, job_id: str, event: str) -> JobEvent | None:
    """The job's newest event that webhook `event` (started|progress|completed) reports."""
    types = EVENT_TYPES.get(event, frozenset())
    return next((e for e in store.latest_events(job_id, EVENT_LOOKBACK) if e.type in types), None)


def view_at(
    record: JobRecord, spec: JobSpec, source: JobEvent, objects: ObjectStore | None
) -> JobView:
    """The job's view as of `source`: from the event, the record only for what it cannot change.

    A finished job's record is final, so a terminal event takes it whole; a start or a progress
    write is reported as the running job it was then, whatever the job has become since.
    """
    view = job_view(record, objects, spec=spec)
    event = parse_event(source)
    if is_terminal(event.type):
        return view.model_copy(update={"status": JobState(event.type)})
    if event.type in _PAUSE_STATUS:
        return view.model_copy(update={"status": _PAUSE_STATUS[event.type], "progress": None})
    update: dict[str, Any] = {
        "status": JobState.RUNNING,
        "finished_at": None,
        "outputs": [],
        "error": None,
        "metrics": Metrics(),
    }
    if isinstance(event, RunningEvent):
        update.update(started_at=event.time, attempts=event.payload.attempts, progress=None)
    elif isinstance(event, StepPreviewEvent):  # a preview is taken while denoising, after its step
        step, total = event.payload.step, event.payload.total
        update["progress"] = Progress(stage="denoising", step=step, total=total)
    elif isinstance(event, ProgressEvent):
        update["progress"] = progress_view(event.payload)
    return view.model_copy(update=update)


def webhook_payload(
    record: JobRecord, spec: JobSpec, event: str, source: JobEvent, objects: ObjectStore | None
) -> str:
    """The JSON body: `{type: job.<event>, timestamp, seq, data: <job view>}`, all as of `source`.

    `timestamp` is when the event happened and `seq` its place in the job's event stream, so a
    receiver can order webhooks that arrive out of order.
    """
    body = {
        "type": f"job.{event}",
        "timestamp": datetime.fromtimestamp(source.time, tz=UTC).isoformat(),
        "seq": source.seq,
        "data": view_at(record, spec, source, objects).model_dump(mode="json"),
    }
    if source.type == "preview":  # the preview event's own data: its image inline or by URL
        body["preview"] = preview_of(source).wire()
    return json.dumps(body, separators=(",", ":"))


def signed_headers(secret: str, webhook_id: str, payload: str, now: float) -> dict[str, str]:
    """Standard Webhooks headers for one attempt (new timestamp, same id)."""
    timestamp = datetime.fromtimestamp(int(now), tz=UTC)
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(int(now)),
        "webhook-signature": Webhook(secret).sign(webhook_id, timestamp, payload),
        "content-type": "application/json",
        "user-agent": USER_AGENT,
    }
