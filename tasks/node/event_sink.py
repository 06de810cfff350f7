"""The one way a node's job events leave it: the job's stream in Redis, then every listener.

A node writes three kinds of events itself (`progress`, `preview`, `output`: the typed payloads of
tasks/contract/events.py) and announces the state changes its transitions wrote (`running`, and a
terminal one). Both go through `EventSink`: a written payload goes to Redis first (fenced by the
job's lease token: the job's record and its event stream, in one script), then the sink tells its
listeners, in order: the node's metrics (`kiln_node_job_events_total`), and whatever else a node
adds with `add_listener` (one place, as Dramatiq's middleware). A job's webhooks are the job's own
listener (`JobEvents.webhooks`), since only its delivery knows whether it asked for any; they hear
the same events after the node-wide ones. A listener's failure is logged, never raised: an event's
listeners never change the job's outcome.

Callers hold a `JobEvents` (one job, one lease token) and never touch the store for an event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore
from kiln.tasks.contract.events import NodePayload, ProgressData
from kiln.tasks.webhooks.enqueue import webhook_event_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventNote:
    """What a listener hears: the job, and the type of the event it has now (written before)."""

    job_id: str
    type: str


EventListener = Callable[[EventNote], None]


@dataclass(frozen=True)
class JobEvents:
    """One job's events on this node, fenced by `lease_token`.

    `webhooks` hears the webhook event (`started`, `progress`, `preview`, `completed`) of each
    event that has one; `output` events have none.
    """

    sink: EventSink
    job_id: str
    lease_token: int
    webhooks: Callable[[str], None] | None = None

    def write(self, payload: NodePayload) -> None:
        """Write a `progress`, `preview` or `output` event (StorageError: not written)."""
        self.sink.write(self, payload)

    def changed(self, state: JobState) -> None:
        """The job's transition to `state` was written: tell the listeners."""
        self.sink.tell(self, state.value)


class EventSink:
    """Writes a node's job events to Redis and hands each one to every listener."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._listeners: list[EventListener] = []

    def add_listener(self, listener: EventListener) -> None:
        """Hear every event this node writes or announces, after it is in Redis."""
        self._listeners.append(listener)

    def job(
        self, job_id: str, lease_token: int, webhooks: Callable[[str], None] | None = None
    ) -> JobEvents:
        """The events of one job whose lease this node holds with `lease_token`."""
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
        self.tell(job, payload.kind)

    def tell(self, job: JobEvents, event_type: str) -> None:
        """Hand an event already in Redis to the listeners, then to the job's webhooks."""
        note = EventNote(job.job_id, event_type)
        for listener in self._listeners:
            _hand(listener, note)
        webhooks, kind = job.webhooks, webhook_event_for(event_type)
        if webhooks is not None and kind is not None:  # `started`, `progress`, `completed`, ...
            _hand(lambda _: webhooks(kind), note)


def _hand(listener: EventListener, note: EventNote) -> None:
    try:
        listener(note)
    except Exception:  # a listener never changes what the job did
        log.exception("a listener of %s's %s event failed", note.job_id, note.type)
