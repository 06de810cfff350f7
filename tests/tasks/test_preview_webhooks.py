"""The opt-in `preview` webhook: only when asked, its body carries the preview and the step."""

from __future__ import annotations

from typing import Any

from kiln.storage.job_store import JobStore
from kiln.tasks.webhooks.delivery import WebhookDeps, deliver_once
from kiln.tasks.webhooks.enqueue import enqueue_webhook_events
from tests.tasks.helpers import Receiver, start_job
from tests.tasks.test_webhooks import RecordingProducer, deps, verify, webhook_job

__all__ = ["deps"]  # the fixture, shared with test_webhooks.py

PREVIEW = {
    "step": 3,
    "total": 8,
    "width": 8,
    "height": 8,
    "format": "webp",
    "content_type": "image/webp",
    "image_b64": "UklGRg==",
    "url": None,
}


def test_a_preview_webhook_goes_only_where_asked(job_store: JobStore) -> None:
    producer = RecordingProducer()
    send: Any = producer
    quiet = webhook_job(job_store, "https://example.com/h", ["progress", "completed"])
    token = start_job(job_store, quiet)
    job_store.add_live_event(quiet, token, "preview", PREVIEW)
    assert enqueue_webhook_events(job_store, quiet, "preview", app=send) is None
    asked = webhook_job(job_store, "https://example.com/h", ["preview"])
    token = start_job(job_store, asked)
    seq = job_store.add_live_event(asked, token, "preview", PREVIEW)
    assert enqueue_webhook_events(job_store, asked, "preview", app=send) == (
        f"msg_{asked}_preview_{seq}"
    )


def test_the_preview_webhook_body(deps: WebhookDeps, receiver: Receiver) -> None:
    store, producer = deps.store, RecordingProducer()
    send: Any = producer
    job_id = webhook_job(store, receiver.url, ["preview", "completed"])
    token = start_job(store, job_id)
    store.add_live_event(job_id, token, "preview", PREVIEW)
    assert enqueue_webhook_events(store, job_id, "preview", app=send)
    for delivery in producer.deliveries():
        assert deliver_once(deps, delivery) is None
    (body,) = (verify(hit) for hit in receiver.hits)
    assert body["type"] == "job.preview"
    assert body["preview"] == PREVIEW
    assert body["data"]["status"] == "running"
    assert body["data"]["progress"] == {"stage": "denoising", "step": 3, "total": 8}
