"""Webhooks: which job events become callbacks, and the Celery task that delivers them.

Delivery runs on the `webhooks` queue, never in a GPU node's task thread, so a slow receiver never
holds a GPU. Retries are new messages carrying an absolute `not_before`; a delay longer than half
the broker's visibility timeout travels in hops, because a Redis-broker message held past the
visibility timeout would be delivered twice.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

from celery import Celery, current_app, shared_task

from storage.objects import open_object_store
from storage.settings import StorageSettings
from storage.status import TERMINAL_STATES, JobRecord, JobStore
from tasks.lanes import WEBHOOKS_QUEUE
from tasks.schemas import WebhookEvent
from tasks.settings import KilnSettings
from tasks.webhook_delivery import Delivery, WebhookDeps, deliver_once

log = logging.getLogger(__name__)
DELIVER_WEBHOOK_TASK = "kiln.deliver_webhook"
DEFAULT_PROGRESS_INTERVAL_S = 5.0


def webhook_event_for(job_event: str) -> WebhookEvent | None:
    """The webhook event of a job event (webhook event name, state name or `progress`)."""
    if job_event in {str(e) for e in WebhookEvent}:
        return WebhookEvent(job_event)
    if job_event == "running":
        return WebhookEvent.started
    if job_event == "progress":
        return WebhookEvent.progress
    if job_event in {str(state) for state in TERMINAL_STATES}:
        return WebhookEvent.completed
    return None


def webhook_id_for(record: JobRecord, event: WebhookEvent) -> str:
    """A deterministic id per (job, event occurrence): the same on every retry and re-enqueue."""
    if event is WebhookEvent.completed:
        return f"msg_{record.id}_completed"
    if event is WebhookEvent.started:
        return f"msg_{record.id}_started_{record.attempts}"
    step = (record.progress or {}).get("step")
    marker = step if step is not None else int(time.time() * 1000)
    return f"msg_{record.id}_progress_{record.attempts}_{marker}"


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
    store: JobStore,
    job_id: str,
    event: str,
    *,
    record: JobRecord | None = None,
    app: Celery | None = None,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
) -> str | None:
    """Queue the webhook for a job event (a state name or `progress`) if the job asked for it.

    Call after each state change and each progress write; progress is throttled here. Returns the
    webhook id queued, or None. Never raises for a publishing failure: webhooks are best effort.
    """
    kind = webhook_event_for(event)
    if kind is None:
        return None
    if kind is WebhookEvent.completed:
        _throttle.forget(job_id)
    elif kind is WebhookEvent.progress and not _throttle.allow(job_id, progress_interval_s):
        return None
    record = record if record is not None else store.get(job_id)
    spec = record.request.get("webhook")
    if not spec or str(kind) not in spec.get("events", []):
        return None
    delivery = Delivery(job_id=job_id, event=str(kind), webhook_id=webhook_id_for(record, kind))
    try:
        publish_delivery(app or current_app, delivery, countdown=0.0)
    except Exception as exc:  # a webhook must never fail the job that caused it
        log.warning("could not queue webhook %s: %s", delivery.webhook_id, exc)
        return None
    return delivery.webhook_id


def publish_delivery(app: Celery, delivery: Delivery, countdown: float) -> None:
    """Send the delivery task to the webhooks queue."""
    app.send_task(
        DELIVER_WEBHOOK_TASK,
        kwargs=delivery.as_kwargs(),
        queue=WEBHOOKS_QUEUE,
        countdown=countdown if countdown > 0 else None,
    )


@functools.cache
def _worker_deps() -> WebhookDeps:
    # The webhook worker's entry point is this task: settings come from its environment once.
    storage_settings = StorageSettings()
    return WebhookDeps(
        settings=KilnSettings(),
        store=JobStore.from_settings(storage_settings),
        objects=open_object_store(storage_settings),
    )


def hop_seconds(settings: KilnSettings) -> float:
    """Longest countdown one message may carry (half the visibility timeout)."""
    return max(1.0, settings.visibility_timeout_s / 2)


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
) -> None:
    """Celery task: deliver one webhook message (one attempt; retries are new messages)."""
    delivery = Delivery(job_id, event, webhook_id, attempt, not_before)
    run_delivery(self.app, _worker_deps(), delivery)
