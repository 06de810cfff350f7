"""The typed event union (tasks/contract/events.py) and the one sink (webhooks/event_sink.py).

Every kind round-trips as its real writer (a transition script, or the sink) stored it; a
malformed event is refused by its writer, before Redis; the sink's one write reaches the job's
stream, every listener, the node's metrics and the job's webhooks (delivered, signed, to a real
receiver).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from prometheus_client.core import Metric
from pydantic import ValidationError

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore
from kiln.storage.preemption import PreemptionOps
from kiln.tasks.contract.events import (
    EVENT_TYPES,
    OutputPayload,
    PreviewPayload,
    ProgressData,
    StepPreviewEvent,
    event_json,
    parse_event,
    preview_of,
)
from kiln.tasks.node.metrics import NodeMetrics
from kiln.tasks.queue.controls import PURGED
from kiln.tasks.webhooks.delivery import WebhookDeps, deliver_once
from kiln.tasks.webhooks.event_sink import EventNote, EventSink
from tests.tasks.helpers import Receiver, finish_with_success, queued_job, start_job
from tests.tasks.test_webhooks import RecordingProducer, deps, verify, webhook_job

__all__ = ["deps"]  # the fixture, from test_webhooks.py

PREVIEW = PreviewPayload(
    step=3,
    total=8,
    width=8,
    height=8,
    format="webp",
    content_type="image/webp",
    image_b64="UklGRg==",
    url=None,
)
OUTPUT = OutputPayload(
    index=0,
    url="file:///tmp/out/0.png",
    key="outputs/j/0.png",
    sha256="ab" * 32,
    bytes=3,
    content_type="image/png",
    width=64,
    height=64,
    frames=1,
)
ERROR = {"type": "WorkerGroupDied", "message": "rank 1 died", "retryable": True}


def stored(store: JobStore, job_id: str) -> list[dict[str, Any]]:
    return [
        {"seq": e.seq, "type": e.type, "time": e.time, "payload": e.payload}
        for e in store.events(job_id)
    ]


def every_kind_written(store: JobStore) -> list[str]:
    """Jobs whose streams hold every kind of event, each written by its real writer."""
    sink = EventSink(store)
    ran = queued_job(store)  # queued (created)
    token = store.acquire_lease(ran, "node-1/d1")
    store.start(ran, token, node_id="node-1")  # running, with its node
    events = sink.job(ran, token)
    events.write(ProgressData(stage="denoising", step=1, total=8))
    events.write(PREVIEW)
    events.write(OUTPUT)
    finish_with_success(store, ran, token)  # progress, succeeded

    retried = queued_job(store)
    token = start_job(store, retried)
    store.requeue(retried, token, ERROR)  # queued (retry, with the attempt's error)
    store.fail(retried, None, {**ERROR, "retryable": False})  # failed

    lapsed = queued_job(store)
    token, _ = store.hold(lapsed, "node-1/d2", "node-1", 2)  # progress (waiting_in_node)
    store.start(lapsed, token)
    store.redis.delete(store.keys.lease(lapsed))
    assert store.reap(lapsed)  # queued (lease_expired)

    canceled, purged, expired, stopped = (queued_job(store) for _ in range(4))
    store.cancel(canceled)  # canceled (requested)
    store.cancel_queued(purged, PURGED)  # canceled (purged)
    store.expire(expired)  # expired
    token = start_job(store, stopped)
    store.cancel(stopped)  # a cancel flag on a running job
    store.requeue(stopped, token, ERROR)  # canceled (cancel_requested)
    preempted = queued_job(store)
    token = start_job(store, preempted)
    # queued (preempted), then preempted
    PreemptionOps(store.redis, store.settings).requeue_preempted(preempted, token, ran)
    paused = queued_job(store)
    store.pause(paused)  # paused (requested)
    store.resume(paused)  # resumed
    token = start_job(store, paused)
    store.pause(paused)  # a pause request on a running job
    store.pause_stopped(paused, token)  # paused (pause_requested)
    store.expire_paused(paused)  # expired (paused_retention)
    return [ran, retried, lapsed, canceled, purged, expired, stopped, preempted, paused]


def test_every_kind_round_trips_as_its_writer_stored_it(job_store: JobStore) -> None:
    seen: set[str] = set()
    reasons: set[str] = set()
    for job_id in every_kind_written(job_store):
        for entry in stored(job_store, job_id):
            event = parse_event(job_store.events(job_id, after_seq=entry["seq"] - 1, count=1)[0])
            assert event_json(event) == entry  # what the SSE route and webhooks send on
            seen.add(event.type)
            reasons.add(str(entry["payload"].get("reason", "")))
    assert seen == set(EVENT_TYPES)
    assert {"created", "retry", "lease_expired", "requested", "purged", "cancel_requested"} | {
        "pause_requested",
        "paused_retention",
        "preempted",
    } <= (reasons)


def test_a_preview_reads_back_typed_with_its_image(job_store: JobStore) -> None:
    job_id = queued_job(job_store)
    EventSink(job_store).job(job_id, start_job(job_store, job_id)).write(PREVIEW)
    (entry,) = (e for e in job_store.events(job_id) if e.type == "preview")
    assert isinstance(parse_event(entry), StepPreviewEvent)
    assert preview_of(entry) == PREVIEW
    assert entry.payload == PREVIEW.wire()  # the wire: both image_b64 and url, one null
    assert set(entry.payload) == {*PreviewPayload.model_fields}


@pytest.mark.parametrize(
    "build",
    [
        lambda: PreviewPayload(**{**PREVIEW.wire(), "image_b64": None}),  # neither inline nor URL
        lambda: PreviewPayload(**{**PREVIEW.wire(), "url": "https://x/p.webp"}),  # both
        lambda: PreviewPayload(**{**PREVIEW.wire(), "width": "wide"}),
        lambda: ProgressData.model_validate({"stage": "denoising", "step": "two"}),
        lambda: OutputPayload(**{k: v for k, v in OUTPUT.wire().items() if k != "sha256"}),
    ],
    ids=["preview-without-image", "preview-with-both", "preview-bad-width", "progress", "output"],
)
def test_a_malformed_event_is_refused_by_its_writer(build: Any) -> None:
    with pytest.raises(ValidationError):
        build()


def test_a_transition_refuses_a_reason_its_event_cannot_carry(job_store: JobStore) -> None:
    job_id = queued_job(job_store)
    bogus: Any = "because"
    with pytest.raises(ValidationError):
        job_store.cancel_queued(job_id, bogus)
    assert job_store.get(job_id).state == JobState.QUEUED  # refused before Redis
    assert [e.type for e in job_store.events(job_id)] == ["queued"]


def test_the_sink_writes_only_typed_payloads(job_store: JobStore) -> None:
    job_id = queued_job(job_store)
    events = EventSink(job_store).job(job_id, start_job(job_store, job_id))
    before = stored(job_store, job_id)
    untyped: Any = {"stage": "denoising", "step": 1, "total": 2}
    with pytest.raises(TypeError, match="not a node event payload"):
        events.write(untyped)
    assert stored(job_store, job_id) == before  # nothing reached Redis


def test_a_stored_entry_that_is_no_event_is_refused_by_its_reader(job_store: JobStore) -> None:
    job_id = queued_job(job_store)
    token = start_job(job_store, job_id)
    job_store.add_live_event(job_id, token, "preview", {"step": 1})  # past the union, by hand
    (entry,) = (e for e in job_store.events(job_id) if e.type == "preview")
    with pytest.raises(ValidationError):
        parse_event(entry)


class NothingScraped:
    """The node's scrape-time collector, with nothing to read (no group here)."""

    def collect(self) -> Iterable[Metric]:
        return []


def test_the_sink_fans_out_to_redis_listeners_metrics_and_webhooks(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    store, producer = deps.store, RecordingProducer()
    send: Any = producer
    sink = EventSink(store, send, progress_interval_s=0)
    metrics = NodeMetrics("node-1", ["tiny"], NothingScraped())
    heard: list[EventNote] = []

    def broken(_: EventNote) -> None:
        raise RuntimeError("a listener that fails")

    for listener in (metrics.count_event, broken, heard.append):
        sink.add_listener(listener)
    hooks = ["started", "progress", "preview", "completed"]
    job_id = webhook_job(store, receiver.url, hooks)
    token = start_job(store, job_id)

    events = sink.job(job_id, token, webhooks=True)
    events.changed(JobState.RUNNING)
    events.write(ProgressData(stage="denoising", step=1, total=8))
    events.write(PREVIEW)
    events.write(OUTPUT)
    store.succeed(job_id, token, [OUTPUT.wire()], {"run_s": 0.5})
    events.changed(JobState.SUCCEEDED)

    written = ["running", "progress", "preview", "output", "succeeded"]
    assert [e.type for e in store.events(job_id)] == ["queued", *written]  # Redis
    assert heard == [EventNote(job_id, kind) for kind in written]  # past the broken listener
    for kind in written:  # the node's metrics
        sample = metrics.registry.get_sample_value(
            "kiln_node_job_events_total", {"node_id": "node-1", "type": kind}
        )
        assert sample == 1.0, kind
    assert [t.kwargs["event"] for t in producer.sent] == hooks  # the job's webhooks
    for delivery in producer.deliveries():
        assert deliver_once(deps, delivery) is None
    bodies = [verify(hit) for hit in receiver.hits]
    assert sorted(body["type"] for body in bodies) == sorted(f"job.{hook}" for hook in hooks)
    (preview,) = (body for body in bodies if body["type"] == "job.preview")
    assert preview["preview"] == PREVIEW.wire()
