"""Batch webhooks from the feeder: `batch.progress` (throttled) and one event at the batch's end.

A batch's `webhook_url` gets the batch events its `webhook_events` ask for: `progress` →
`batch.progress` (at most one per `batch_progress_interval_s` per batch, and only when lines have
finished since the last one); `completed` → the end of the batch, named by
`contract.batches.batch_event_of` (`batch.completed`, `batch.failed`, `batch.expired`,
`batch.canceled`). The lines' own job webhooks go to the same URL. Best effort: a webhook that
cannot be queued never changes the batch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import current_app

from kiln.storage.batch_records import FedBatch
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import BatchEvent, BatchView, batch_event_of
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.webhooks.batch_hooks import (
    BatchDelivery,
    batch_webhook_body,
    batch_webhook_id,
    publish_batch_delivery,
)

log = logging.getLogger(__name__)


def finished_lines(view: BatchView) -> int:
    """Lines that have their outcome (results may not be written yet)."""
    c = view.counts
    return c.succeeded + c.failed + c.canceled + c.expired + c.invalid


class BatchNotifier:
    """Queues a feeder's batch webhooks through a Celery app (None: the current one)."""

    def __init__(self, settings: KilnSettings, app: Any | None = None) -> None:
        self.settings = settings
        self.app = app
        self._last: dict[str, tuple[float, int]] = {}  # batch -> (monotonic time, lines finished)

    def forget_except(self, active: set[str]) -> None:
        """Drop the throttle entries of batches no longer active."""
        self._last = {b: sent for b, sent in self._last.items() if b in active}

    def progress(self, batch: FedBatch) -> None:
        """Queue a `batch.progress` webhook if asked for, due, and lines finished since the last."""
        if batch.final or not _asks(batch, "progress"):
            return
        sent_at, sent_done = self._last.get(batch.id, (float("-inf"), 0))
        now = time.monotonic()
        if now - sent_at < self.settings.batch_progress_interval_s:
            return  # checked before the view is built: most visits stop here
        view = batch_view(batch)
        done = finished_lines(view)
        if done == sent_done:
            return
        self._last[batch.id] = (now, done)
        self._queue(batch, BatchEvent.progress, view)

    def finished(self, batch: FedBatch) -> None:
        """Queue the webhook of the batch's end, if asked for (`batch` is final)."""
        self._last.pop(batch.id, None)
        if not _asks(batch, "completed"):
            return
        view = batch_view(batch)
        self._queue(batch, batch_event_of(view.status, view.outcome), view)

    def _queue(self, batch: FedBatch, event: BatchEvent, view: BatchView) -> None:
        if batch.webhook is None:
            return
        delivery = BatchDelivery(
            batch_id=batch.id,
            event=str(event),
            webhook_id=batch_webhook_id(batch.id, str(event), finished_lines(view)),
            url=str(batch.webhook["url"]),
            body=batch_webhook_body(str(event), view.model_dump(mode="json"), time.time()),
            trace=dict(batch.trace) or None,
        )
        try:
            publish_batch_delivery(self.app or current_app, delivery)
        except Exception as exc:  # a webhook must never fail the batch that caused it
            log.warning("could not queue the %s webhook of batch %s: %s", event, batch.id, exc)


def _asks(batch: FedBatch, event: str) -> bool:
    return batch.webhook is not None and event in (batch.webhook.get("events") or [])
