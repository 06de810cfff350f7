"""The one way a job's events leave a process: the job's stream in Redis, its listeners, webhooks.

Every process that moves a job on holds an `EventSink` (a node; the API and `kiln admin purge`
canceling; the batch feeder stopping a batch's jobs), so there is one path from "a job's event
happened" to "its webhooks are queued". A node writes three kinds of events itself (`progress`,
`preview`, `output`: the typed payloads of tasks/contract/events.py) and announces the state
changes its transitions wrote (`running`, a terminal one). A written payload goes to Redis first
(fenced by the job's lease token: the job's record and its event stream, in one script), then the
sink tells its listeners, in order: whatever its process added with `add_listener` (a node's
metrics, `kiln_node_job_events_total`: one place, as Dramatiq's middleware), then the job's
webhooks. A change written with no lease (a cancel, a purge, an expiry or a refusal before any
attempt) is announced with `changed(record)`, the record its transition returned, and goes the
same way. A listener's or a webhook's failure is logged, never raised: an event's listeners never
change the job's outcome.

This module sits in the webhooks room, the lowest one that can queue a webhook, so every room
above it (node, api, control, batches, cli) takes the same sink.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from celery import Celery

from kiln.common.states import JobState
from kiln.storage.job_store import JobRecord, JobStore
from kiln.tasks.contract.events import NodePayload, ProgressData
from kiln.tasks.webhooks.enqueue import (
    DEFAULT_PROGRESS_INTERVAL_S,
    enqueue_webhook_events,
    webhook_event_for,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventNote:
    """What a listener hears: the job, and the type of the event it has now (written before)."""

    job_id: str
    type: str


EventListener = Callable[[EventNote], None]


@dataclass(frozen=True)
class JobEvents:
    """One job's events on a node, fenced by `lease_token`.

    `webhooks`: whether the job asked for any (its decoded spec says), so a job without them
    costs no read of its record per event.
    """

    sink: EventSink
    job_id: str
    lease_token: int
    webhooks: bool = False

    def write(self, payload: NodePayload) -> None:
        """Write a `progress`, `preview` or `output` event (StorageError: not written)."""
        self.sink.write(self, payload)

    def changed(self, state: JobState) -> None:
        """The job's transition to `state` was written: tell the listeners."""
        self.sink.tell(self.job_id, state.value, webhooks=self.webhooks)


class EventSink:
    """Writes a job's events to Redis and hands each one to every listener, then its webhooks.

    `app` publishes the webhook deliveries (None: Celery's current app); progress webhooks go at
    most once per `progress_interval_s` per job.
    """

    def __init__(
        self,
        store: JobStore,
        app: Celery | None = None,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    ) -> None:
        self.store = store
        self.app = app
        self.progress_interval_s = progress_interval_s
        self._listeners: list[EventListener] = []

    def add_listener(self, listener: EventListener) -> None:
        """Hear every event this sink writes or announces, after it is in Redis."""
        self._listeners.append(listener)

    def job(self, job_id: str, lease_token: int, webhooks: bool = False) -> JobEvents:
        """The events of one job whose lease this process holds with `lease_token`."""
        return JobEvents(self, job_id, lease_token, webhooks)

    def write(self, job: JobEvents, payload: NodePayload) -> None:
        """Append the event to the job's stream (fenced), then tell the listeners.

        Only the contract's typed payloads are written: a dict, or a model of another kind, is a
        TypeError here, before anything reaches Redis.
        """
        if not isinstance(payload, NodePayload):
            raise TypeError(f"not a node event payload: {type(payload).__name__}")
        if isinstance(payload, ProgressData):  # the record's progress and its event, together
            self.store.set_progress(job.job_id, job.lease_token, payload.wire())
        else:
            self.store.add_live_event(job.job_id, job.lease_token, payload.kind, payload.wire())
        self.tell(job.job_id, payload.kind, webhooks=job.webhooks)

    def changed(self, record: JobRecord) -> None:
        """A transition written without a lease left the job as `record`: tell the listeners.

        Its webhooks read the job's spec from `record` (no second read of the job).
        """
        self.tell(record.id, record.state.value, webhooks=True, record=record)

    def tell(
        self,
        job_id: str,
        event_type: str,
        *,
        webhooks: bool,
        record: JobRecord | None = None,
    ) -> None:
        """Hand an event already in Redis to the listeners, then to the job's webhooks."""
        note = EventNote(job_id, event_type)
        for listener in self._listeners:
            _hand(listener, note)
        kind = webhook_event_for(event_type)
        if webhooks and kind is not None:  # `started`, `progress`, `completed`, ...

            def queue(_: EventNote) -> None:
                enqueue_webhook_events(
                    self.store,
                    job_id,
                    str(kind),
                    record=record,
                    app=self.app,
                    progress_interval_s=self.progress_interval_s,
                )

            _hand(queue, note)


def _hand(listener: EventListener, note: EventNote) -> None:
    try:
        listener(note)
    except Exception:  # a listener never changes what the job did
        log.exception("a listener of %s's %s event failed", note.job_id, note.type)
