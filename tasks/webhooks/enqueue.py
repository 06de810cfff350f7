"""Webhooks: which job events become callbacks, and the Celery task that delivers them.

Delivery runs on the `webhooks` queue, never in a GPU node's task thread, so a slow receiver never
holds a GPU. Each message pins the job event it reports (seq, type, time, payload) when queued, so a
webhook says what happened then, not where the job is by the time it is sent. Retries are new
messages carrying an absolute `not_before`; a delay longer than half the broker's visibility timeout
travels in hops, because a Redis-broker message held past the visibility timeout would be delivered
twice.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import Celery, current_app, shared_task

from kiln.common.states import JobState, is_terminal
from kiln.storage.job_store import JobEvent, JobRecord
from kiln.storage.queries import QueryOps
from kiln.tasks.contract.schemas import WebhookEvent, WebhookSpec
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE
from kiln.tasks.queue.process import this_process

# imported for its Celery task: the webhook worker's app includes this module only
from kiln.tasks.webhooks import batch_hooks  # noqa: F401
from kiln.tasks.webhooks.delivery import (
    Delivery,
    WebhookDeps,
    deliver_once,
    event_from_kwargs,
    hop_seconds,
    readable_spec,
)
from kiln.tasks.webhooks.message import find_event

log = logging.getLogger(__name__)
DELIVER_WEBHOOK_TASK = "kiln.deliver_webhook"
# KILN_WEBHOOK_PROGRESS_INTERVAL_S's own default, for callers that hold no settings
DEFAULT_PROGRESS_INTERVAL_S: float = KilnSettings.model_fields[
    "webhook_progress_interval_s"
].default


def webhook_event_for(job_event: str) -> WebhookEvent | None:
    """The webhook event of a job event (webhook event name, state name or `progress`)."""
    if job_event in {str(e) for e in WebhookEvent}:
        return WebhookEvent(job_event)
    if job_event == JobState.RUNNING:
        return WebhookEvent.started
    if job_event == "progress":
        return WebhookEvent.progress
    if is_terminal(job_event):
        return WebhookEvent.completed
    return None


def webhook_id_for(job_id: str, event: WebhookEvent, source: JobEvent) -> str:
    """A deterministic id per reported job event: the same on every retry and re-enqueue.

    A job completes once, so `completed` keeps one id; a start or a progress write is named by its
    event's seq, unique in the job's stream (steps restart at 1 in each stage, seqs never repeat).
    """
    if event in (WebhookEvent.completed, WebhookEvent.dead):  # once per job, each
        return f"msg_{job_id}_{event}"
    return f"msg_{job_id}_{event}_{source.seq}"


class ProgressThrottle:
    """Lets one progress webhook per job through every `interval_s` (per process)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def allow(self, job_id: str, interval_s: float) -> bool:
        """Whether a progress webhook for this job may go now (and note that it did)."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(job_id, float("-inf")) < interval_s:
                return False
            self._last[job_id] = now
            return True

    def forget(self, job_id: str) -> None:
        """Drop a finished job's entry."""
        with self._lock:
            self._last.pop(job_id, None)


_throttle = ProgressThrottle()


def enqueue_webhook_events(
    store: QueryOps,
    job_id: str,
    event: str,
    *,
    record: JobRecord | None = None,
    app: Celery | None = None,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
) -> str | None:
    """Queue the webhook for a job event (a state name or `progress`) if the job asked for it.

    Call after each state change and each progress write; progress is throttled here. The message
    pins the job's newest event of that kind. Returns the webhook id queued, or None. Never raises
    for a publishing failure: webhooks are best effort.
    """
    kind = webhook_event_for(event)
    if kind is None or not _throttle_allows(job_id, kind, progress_interval_s):
        return None
    record = record if record is not None else store.get(job_id)
    job_spec = readable_spec(record)
    spec = None if job_spec is None else job_spec.webhook
    if spec is None:
        return None
    if kind is WebhookEvent.completed and record.state == JobState.FAILED:
        # a failure for good also has its own event, for receivers of dead letters only
        _queue_webhook(store, job_id, WebhookEvent.dead, spec, app)
    return _queue_webhook(store, job_id, kind, spec, app)


def _queue_webhook(
    store: QueryOps, job_id: str, kind: WebhookEvent, spec: WebhookSpec, app: Celery | None
) -> str | None:
    """Queue the `kind` webhook of the job if its `spec` subscribes to it; its id, or None."""
    if kind not in spec.events:
        return None
    try:
        delivery = pinned_delivery(store, job_id, kind)
        if delivery is not None:
            publish_delivery(app or current_app, delivery, countdown=0.0)
    except Exception as exc:  # a webhook must never fail the job that caused it
        log.warning("could not queue the %s webhook of job %s: %s", kind, job_id, exc)
        return None
    return None if delivery is None else delivery.webhook_id


def _throttle_allows(job_id: str, kind: WebhookEvent, interval_s: float) -> bool:
    """Whether this webhook may go now (only progress is throttled; completion resets it)."""
    if kind is WebhookEvent.completed:
        _throttle.forget(job_id)
        return True
    return kind is not WebhookEvent.progress or _throttle.allow(job_id, interval_s)


def pinned_delivery(store: QueryOps, job_id: str, kind: WebhookEvent) -> Delivery | None:
    """The first delivery of the webhook reporting the job's newest `kind` event, if any."""
    source = find_event(store, job_id, str(kind))
    if source is None:
        log.warning("job %s has no event for a %s webhook; none queued", job_id, kind)
        return None
    return Delivery(job_id, str(kind), webhook_id_for(job_id, kind, source), source=source)


def publish_delivery(app: Celery, delivery: Delivery, countdown: float) -> None:
    """Send the delivery task to the webhooks queue."""
    app.send_task(
        DELIVER_WEBHOOK_TASK,
        kwargs=delivery.as_kwargs(),
        queue=WEBHOOKS_QUEUE,
        countdown=countdown if countdown > 0 else None,
    )


def _worker_deps() -> WebhookDeps:
    # The webhook worker's entry point is this task: its process's parts (a node's, the same
    # settings and Redis client as the node).
    parts = this_process()
    return WebhookDeps(settings=parts.settings, store=parts.store, objects=parts.objects)


def run_delivery(app: Celery, deps: WebhookDeps, delivery: Delivery) -> None:
    """Wait out `not_before` in hops, else attempt once and schedule the retry, if any."""
    wait = (delivery.not_before or 0.0) - time.time()
    if wait > 0.05:
        publish_delivery(app, delivery, countdown=min(wait, hop_seconds(deps.settings)))
        return
    following = deliver_once(deps, delivery)
    if following is not None:
        remaining = (following.not_before or 0.0) - time.time()
        publish_delivery(app, following, countdown=min(remaining, hop_seconds(deps.settings)))


@shared_task(name=DELIVER_WEBHOOK_TASK, bind=True, ignore_result=True, acks_late=True)
def deliver_webhook(
    self: Any,
    job_id: str,
    event: str,
    webhook_id: str,
    attempt: int = 1,
    not_before: float | None = None,
    source: dict[str, Any] | None = None,
    body: str | None = None,
) -> None:
    """Celery task: deliver one webhook message (one attempt; retries are new messages)."""
    delivery = Delivery(
        job_id, event, webhook_id, attempt, not_before, event_from_kwargs(source), body
    )
    run_delivery(self.app, _worker_deps(), delivery)
