"""Ends written outside a node go through the one sink (tasks/webhooks/event_sink.py).

And a webhook of a job whose spec this release cannot read is dropped, logged, never a crash.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

import httpx

from kiln.storage.job_store import JobStore, NewJob
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import JobRequest, WebhookSpec
from kiln.tasks.queue.app import transport_options
from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE
from kiln.tasks.webhooks.delivery import Delivery, WebhookDeps, deliver_once, event_from_kwargs
from kiln.tasks.webhooks.enqueue import enqueue_webhook_events
from kiln.tasks.webhooks.event_sink import EventNote, EventSink
from tests.tasks.helpers import Api, Receiver, drive_to_success
from tests.tasks.test_webhooks import RecordingProducer, deps, verify

__all__ = ["deps"]  # the fixture, from test_webhooks.py


def queued_deliveries(api: Api) -> list[Delivery]:
    """The webhook deliveries the API's Celery app left in the broker's webhooks queue."""
    options = transport_options(api.settings, api.storage_settings.redis_namespace)
    raw = api.store.redis.lrange(str(options["global_keyprefix"]) + WEBHOOKS_QUEUE, 0, -1)
    found = []
    for message in raw:
        envelope = json.loads(message)
        _, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
        found.append(Delivery(**{**kwargs, "source": event_from_kwargs(kwargs["source"])}))
    return found


def test_an_api_cancel_queues_its_webhook_through_the_sink_and_it_is_delivered(
    api: Api, receiver: Receiver
) -> None:
    hook = {"url": receiver.url, "events": ["completed"]}
    body = {"prompt": "p", "width": 64, "height": 64, "webhook": hook}
    job_id = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth()).json()["id"]
    canceled = httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=api.auth()).json()
    assert canceled["effect"] == "canceled"

    (delivery,) = [d for d in queued_deliveries(api) if d.job_id == job_id]
    assert (delivery.event, delivery.webhook_id) == ("completed", f"msg_{job_id}_completed")
    assert delivery.source is not None
    assert delivery.source.type == "canceled"  # pinned when it was queued
    deps = WebhookDeps(api.settings, api.store, None)
    assert deliver_once(deps, delivery) is None
    (hit,) = receiver.hits
    sent = verify(hit)
    assert (sent["type"], sent["data"]["id"], sent["data"]["status"]) == (
        "job.completed",
        job_id,
        "canceled",
    )


def test_a_change_made_outside_a_node_reaches_listeners_and_webhooks(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    producer = RecordingProducer()
    send: Any = producer
    sink = EventSink(deps.store, send)
    heard: list[EventNote] = []
    sink.add_listener(heard.append)
    job_id = stored_job(deps.store, {"url": receiver.url, "events": ["completed"]})

    sink.changed(deps.store.cancel(job_id))  # what the API, a purge and the feeder do

    assert heard == [EventNote(job_id, "canceled")]
    assert [(t.kwargs["job_id"], t.kwargs["event"]) for t in producer.sent] == [
        (job_id, "completed")
    ]


def stored_job(store: JobStore, webhook: dict[str, Any], version: int | None = None) -> str:
    """A queued job stored as a spec (its seed drawn), of `version` when given."""
    hook = WebhookSpec.model_validate(webhook)
    spec = JobSpec.of(JobRequest(prompt="p", width=64, height=64, seed=7, webhook=hook))
    request = spec.encode()
    if version is not None:
        request["version"] = version
    job_id = uuid.uuid4().hex
    store.create_job(NewJob(id=job_id, request=request))
    return job_id


def test_a_webhook_of_a_job_whose_spec_is_unreadable_is_dropped_not_a_crash(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    # a newer release wrote this spec: this release cannot know what its webhook asks for
    job_id = stored_job(deps.store, {"url": receiver.url, "events": ["completed"]}, version=99)
    drive_to_success(deps.store, job_id)
    producer = RecordingProducer()
    send: Any = producer

    assert enqueue_webhook_events(deps.store, job_id, "succeeded", app=send) is None
    EventSink(deps.store, send).changed(deps.store.get(job_id))  # the sink's path: no raise
    assert producer.sent == []
    # a message already queued for it (by a release that could read it) is dropped, unsent
    delivery = Delivery(job_id, "completed", f"msg_{job_id}_completed")
    assert deliver_once(deps, delivery) is None
    assert receiver.hits == []
    assert deps.store.webhook_attempts(job_id) == []  # no URL to record an attempt against


def test_a_readable_job_of_the_same_shape_is_delivered(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    """The control of the test above: version 1 of the same stored spec is sent and recorded."""
    job_id = stored_job(deps.store, {"url": receiver.url, "events": ["completed"]}, version=1)
    drive_to_success(deps.store, job_id)
    delivery = Delivery(job_id, "completed", f"msg_{job_id}_completed")
    assert deliver_once(deps, delivery) is None
    assert verify(receiver.hits[0])["data"]["status"] == "succeeded"
    assert [a["outcome"] for a in deps.store.webhook_attempts(job_id)] == ["delivered"]
