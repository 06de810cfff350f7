"""Batch webhooks: `batch.progress` and the end of a batch, signed and retried like job webhooks.

A batch webhook goes to the batch's `webhook_url`. Its body (`{type, timestamp, data: <batch
view>}`) and URL are fixed when it is queued and travel in the message, so every attempt sends the
same bytes under the same `webhook-id` (only the timestamp and signature are new), and a batch
whose record has expired is still reported. Delivery runs on the `webhooks` queue with the job
webhooks' sender (SSRF checks at each attempt, no redirects), schedule and Retry-After rules.
Attempts are logged, not recorded in Redis (job webhooks' attempt log is per job).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

from celery import Celery, shared_task

from kiln.common.tracing import (
    BATCH_ID_ATTRIBUTE,
    WEBHOOK_ATTEMPT_ATTRIBUTE,
    WEBHOOK_EVENT_ATTRIBUTE,
    WEBHOOK_SPAN,
    SpanKind,
    job_carrier,
    span,
)
from kiln.tasks.contract.backoff import scheduled_delay
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE
from kiln.tasks.queue.process import this_process
from kiln.tasks.webhooks.delivery import hop_seconds, send
from kiln.tasks.webhooks.message import signed_headers

log = logging.getLogger(__name__)
DELIVER_BATCH_WEBHOOK_TASK = "kiln.deliver_batch_webhook"


@dataclass(frozen=True)
class BatchDelivery:
    """One batch webhook message and where it is in its schedule (what the Celery task carries)."""

    batch_id: str
    event: str  # batch.progress, batch.completed, batch.failed, batch.expired, batch.canceled
    webhook_id: str
    url: str
    body: str
    attempt: int = 1
    not_before: float | None = None
    # the batch's W3C trace context: the delivery attempt's span is its child, and the receiver's
    # `traceparent` (kiln/common/tracing.py)
    trace: dict[str, str] | None = None


def batch_webhook_body(event: str, view: dict[str, Any], now: float) -> str:
    """The JSON body: `{type: <event>, timestamp, data: <batch view>}`."""
    timestamp = datetime.fromtimestamp(now, tz=UTC).isoformat()
    return json.dumps({"type": event, "timestamp": timestamp, "data": view}, separators=(",", ":"))


def batch_webhook_id(batch_id: str, event: str, finished_lines: int) -> str:
    """A deterministic id: one per batch end; a progress report is named by the lines finished."""
    name = event.removeprefix("batch.")
    if event == "batch.progress":
        return f"msg_batch_{batch_id}_{name}_{finished_lines}"
    return f"msg_batch_{batch_id}_{name}"


def publish_batch_delivery(app: Any, delivery: BatchDelivery, countdown: float = 0.0) -> None:
    """Send the delivery task to the webhooks queue (by name: no import of the sender)."""
    app.send_task(
        DELIVER_BATCH_WEBHOOK_TASK,
        kwargs=asdict(delivery),
        queue=WEBHOOKS_QUEUE,
        countdown=countdown if countdown > 0 else None,
    )


def deliver_batch_once(
    settings: KilnSettings, delivery: BatchDelivery, rng: random.Random | None = None
) -> BatchDelivery | None:
    """Make one attempt and return the retry to schedule, if any (same body, same id)."""
    secret = settings.webhook_secret
    if secret is None or not secret.get_secret_value():
        log.warning("batch webhook %s refused: no KILN_WEBHOOK_SECRET", delivery.webhook_id)
        return None
    headers = signed_headers(
        secret.get_secret_value(), delivery.webhook_id, delivery.body, time.time()
    )
    facts = {
        BATCH_ID_ATTRIBUTE: delivery.batch_id,
        WEBHOOK_EVENT_ATTRIBUTE: delivery.event,
        WEBHOOK_ATTEMPT_ATTRIBUTE: delivery.attempt,
    }
    given = delivery.trace or {}
    with span(WEBHOOK_SPAN, given, kind=SpanKind.CLIENT, attributes=facts) as attempt:
        trace = job_carrier(attempt, given)
        result = send(delivery.url, {**headers, **trace}, delivery.body, settings)
    log.info(
        "batch webhook %s attempt %d: %s",
        delivery.webhook_id,
        delivery.attempt,
        result.error or result.outcome,
    )
    if result.outcome != "retrying":
        return None
    delay = scheduled_delay(
        delivery.attempt,
        settings.webhook_retry_schedule_s,
        jitter=settings.webhook_retry_jitter,
        rng=rng or random.Random(),
        retry_after=result.retry_after,
        retry_after_max=settings.webhook_retry_after_max_s,
    )
    if delay is None:
        return None
    return replace(delivery, attempt=delivery.attempt + 1, not_before=time.time() + delay)


def _worker_settings() -> KilnSettings:
    # The webhook worker's entry point is this task: its process's settings.
    return this_process().settings


def run_batch_delivery(app: Celery, settings: KilnSettings, delivery: BatchDelivery) -> None:
    """Wait out `not_before` in hops (half the visibility timeout), else attempt once."""
    hop = hop_seconds(settings)
    wait = (delivery.not_before or 0.0) - time.time()
    if wait > 0.05:
        publish_batch_delivery(app, delivery, countdown=min(wait, hop))
        return
    following = deliver_batch_once(settings, delivery)
    if following is not None:
        remaining = (following.not_before or 0.0) - time.time()
        publish_batch_delivery(app, following, countdown=min(remaining, hop))


@shared_task(name=DELIVER_BATCH_WEBHOOK_TASK, bind=True, ignore_result=True, acks_late=True)
def deliver_batch_webhook(
    self: Any,
    batch_id: str,
    event: str,
    webhook_id: str,
    url: str,
    body: str,
    attempt: int = 1,
    not_before: float | None = None,
    trace: dict[str, str] | None = None,
) -> None:
    """Celery task: deliver one batch webhook message (one attempt; retries are new messages)."""
    delivery = BatchDelivery(batch_id, event, webhook_id, url, body, attempt, not_before, trace)
    run_batch_delivery(self.app, _worker_settings(), delivery)
