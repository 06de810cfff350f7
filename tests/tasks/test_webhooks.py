"""Webhooks: schedule math, one attempt at a time against a local receiver, and a real worker.

Signatures are verified with the `standardwebhooks` library, not Kiln's own code.
"""

from __future__ import annotations

import email.utils
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook

from kiln.common.states import JobState
from kiln.storage.job_store import JobEvent, JobStore
from kiln.storage.objects import open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import make_celery_app, transport_options
from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE
from kiln.tasks.webhooks.delivery import (
    Delivery,
    WebhookDeps,
    deliver_once,
    event_from_kwargs,
    parse_retry_after,
)
from kiln.tasks.webhooks.enqueue import enqueue_webhook_events
from tests.conftest import TEST_REDIS_URL, delete_namespace
from tests.tasks.helpers import (
    WEBHOOK_SECRET,
    Hit,
    Receiver,
    api_settings,
    drive_to_success,
    finish_with_success,
    start_job,
)
from tests.tasks.helpers import queued_job as make_queued_job
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def verify(hit: Hit) -> dict[str, Any]:
    """The payload, after the standardwebhooks library checked the signature."""
    payload: dict[str, Any] = Webhook(WEBHOOK_SECRET).verify(hit.body, hit.headers)
    return payload


def webhook_job(store: JobStore, url: str, events: list[str] | None = None) -> str:
    request = JobRequest(
        prompt="p",
        width=64,
        height=64,
        seed=7,  # a stored spec has its seed (drawn at submit); webhooks read the decoded spec
        webhook={"url": url, "events": events or ["completed"]},  # type: ignore[arg-type]
    )
    return make_queued_job(store, request)


def finished_webhook_job(store: JobStore, url: str, events: list[str] | None = None) -> str:
    """A succeeded job (so it has a start, progress and a terminal event) that asked for `url`."""
    job_id = webhook_job(store, url, events)
    drive_to_success(store, job_id)
    return job_id


def event_of(store: JobStore, job_id: str, event_type: str) -> JobEvent:
    """The job's newest event of `event_type`."""
    return next(e for e in reversed(store.events(job_id)) if e.type == event_type)


def iso(epoch: float) -> str:
    """An event time as a webhook's `timestamp` writes it."""
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat()


# --- Retry-After and the schedule (its math: tests/tasks/test_backoff.py) ---------------------


def test_parse_retry_after() -> None:
    now = time.time()
    assert parse_retry_after("120", now) == 120.0
    http_date = email.utils.formatdate(now + 30, usegmt=True)
    parsed = parse_retry_after(http_date, now)
    assert parsed is not None
    assert 28 <= parsed <= 31
    assert parse_retry_after("soon", now) is None
    assert parse_retry_after(None, now) is None


def test_default_schedule_spans_hours() -> None:
    schedule = KilnSettings().webhook_retry_schedule_s
    assert sum(schedule) > 6 * 3600
    assert schedule == sorted(schedule)


# --- one attempt at a time --------------------------------------------------------------------


@pytest.fixture
def deps(job_store: JobStore, storage_settings: StorageSettings) -> WebhookDeps:
    return WebhookDeps(api_settings(), job_store, open_object_store(storage_settings))


def test_delivered_signed_and_recorded(deps: WebhookDeps, receiver: Receiver) -> None:
    job_id = finished_webhook_job(deps.store, receiver.url)
    # no pinned event, as in a message queued by an older Kiln: the newest terminal one stands in
    delivery = Delivery(job_id, "completed", f"msg_{job_id}_completed")
    assert deliver_once(deps, delivery) is None
    payload = verify(receiver.hits[0])
    assert payload["type"] == "job.completed"
    assert payload["data"]["id"] == job_id
    succeeded = event_of(deps.store, job_id, "succeeded")
    assert payload["seq"] == succeeded.seq
    assert payload["timestamp"] == iso(succeeded.time)
    assert payload["data"]["status"] == "succeeded"
    assert payload["data"]["outputs"][0]["url"]
    assert receiver.hits[0].headers["webhook-id"] == f"msg_{job_id}_completed"
    (attempt,) = deps.store.webhook_attempts(job_id)
    assert attempt["outcome"] == "delivered"
    assert attempt["status_code"] == 200
    assert attempt["latency_ms"] > 0
    assert attempt["error"] is None


def test_failure_schedules_a_retry_honouring_retry_after(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    receiver.script = [(503, {"Retry-After": "3"})]
    job_id = finished_webhook_job(deps.store, receiver.url)
    before = time.time()
    following = deliver_once(deps, Delivery(job_id, "completed", "msg_x"))
    assert following is not None
    assert following.attempt == 2
    assert following.webhook_id == "msg_x"
    assert following.body is not None
    assert following.body.encode() == receiver.hits[0].body
    assert following.not_before is not None
    assert following.not_before >= before + 3
    (attempt,) = deps.store.webhook_attempts(job_id)
    assert attempt["outcome"] == "retrying"
    assert attempt["status_code"] == 503
    assert attempt["next_attempt_at"] == following.not_before


def test_last_failure_gives_up(deps: WebhookDeps, receiver: Receiver) -> None:
    receiver.script = [500]
    job_id = finished_webhook_job(deps.store, receiver.url)
    assert deliver_once(deps, Delivery(job_id, "completed", "msg_x", attempt=4)) is None
    assert deps.store.webhook_attempts(job_id)[-1]["outcome"] == "gave_up"


def test_410_stops_this_endpoint(deps: WebhookDeps, receiver: Receiver) -> None:
    receiver.script = [410]
    job_id = finished_webhook_job(deps.store, receiver.url, ["started", "completed"])
    assert deliver_once(deps, Delivery(job_id, "started", "msg_a")) is None
    assert deliver_once(deps, Delivery(job_id, "completed", "msg_b")) is None
    assert len(receiver.hits) == 1
    assert [a["outcome"] for a in deps.store.webhook_attempts(job_id)] == ["gone"]


def test_redirects_are_not_followed(deps: WebhookDeps, receiver: Receiver) -> None:
    elsewhere = Receiver()
    try:
        receiver.script = [(307, {"Location": elsewhere.url})]
        job_id = finished_webhook_job(deps.store, receiver.url)
        assert deliver_once(deps, Delivery(job_id, "completed", "msg_x")) is not None
        assert elsewhere.hits == []
        assert deps.store.webhook_attempts(job_id)[0]["status_code"] == 307
    finally:
        elsewhere.close()


def test_refused_at_delivery_when_not_allowed(job_store: JobStore, receiver: Receiver) -> None:
    strict = WebhookDeps(api_settings(webhook_allow_hosts=[]), job_store, None)
    job_id = finished_webhook_job(job_store, receiver.url)
    assert deliver_once(strict, Delivery(job_id, "completed", "msg_x")) is None
    assert receiver.hits == []
    assert job_store.webhook_attempts(job_id)[0]["outcome"] == "refused"


@dataclass
class SentTask:
    name: str
    kwargs: dict[str, Any]
    queue: str


class RecordingProducer:
    """Stands in for Celery's producer side (not Kiln's code): records what would be sent."""

    def __init__(self) -> None:
        self.sent: list[SentTask] = []

    def send_task(self, name: str, kwargs: dict[str, Any], queue: str, **_: Any) -> None:
        # through JSON, as Celery's default serializer carries task arguments
        self.sent.append(SentTask(name, json.loads(json.dumps(kwargs)), queue))

    def deliveries(self) -> list[Delivery]:
        """The deliveries the recorded messages describe, as the Celery task reads them."""
        return [
            Delivery(**{**t.kwargs, "source": event_from_kwargs(t.kwargs["source"])})
            for t in self.sent
        ]


def test_enqueue_filters_by_subscription_and_throttles_progress(job_store: JobStore) -> None:
    producer = RecordingProducer()
    job_id = webhook_job(job_store, "https://example.com/h", ["progress", "completed"])
    send: Any = producer
    token = start_job(job_store, job_id)
    assert enqueue_webhook_events(job_store, job_id, "running", app=send) is None  # not asked
    assert enqueue_webhook_events(job_store, job_id, "queued", app=send) is None
    job_store.set_progress(job_id, token, {"stage": "denoising", "step": 1, "total": 2})
    first = enqueue_webhook_events(job_store, job_id, "progress", app=send, progress_interval_s=60)
    job_store.set_progress(job_id, token, {"stage": "denoising", "step": 2, "total": 2})
    again = enqueue_webhook_events(job_store, job_id, "progress", app=send, progress_interval_s=60)
    assert first is not None
    assert again is None
    # a running job has no terminal event to report yet
    assert enqueue_webhook_events(job_store, job_id, "completed", app=send) is None
    finish_with_success(job_store, job_id, token, steps=0)
    done = enqueue_webhook_events(job_store, job_id, "succeeded", app=send)
    assert done == enqueue_webhook_events(job_store, job_id, "completed", app=send)
    assert [t.kwargs["event"] for t in producer.sent] == ["progress", "completed", "completed"]
    assert {t.queue for t in producer.sent} == {"webhooks"}
    assert {t.name for t in producer.sent} == {"kiln.deliver_webhook"}


def test_a_late_first_attempt_reports_its_event_not_the_job_now(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    """Webhooks queued while the job ran, first sent after it succeeded, say what happened then."""
    store, producer = deps.store, RecordingProducer()
    send: Any = producer
    job_id = webhook_job(store, receiver.url, ["started", "progress", "completed"])
    token = start_job(store, job_id)
    assert enqueue_webhook_events(store, job_id, "started", app=send)
    store.set_progress(job_id, token, {"stage": "decoding", "step": 1, "total": 1})
    assert enqueue_webhook_events(store, job_id, "progress", app=send, progress_interval_s=0)
    finish_with_success(store, job_id, token, steps=0)
    assert enqueue_webhook_events(store, job_id, "succeeded", app=send)
    for delivery in producer.deliveries():
        assert deliver_once(deps, delivery) is None
    started, progress, completed = (verify(hit) for hit in receiver.hits)
    running = event_of(store, job_id, "running")
    assert started["data"]["status"] == "running"
    assert started["data"]["outputs"] == []
    assert started["data"]["started_at"] == running.time
    assert started["data"]["attempts"] == 1
    assert started["timestamp"] == iso(running.time)
    assert started["seq"] == running.seq
    assert progress["data"]["status"] == "running"
    assert progress["data"]["finished_at"] is None
    assert progress["data"]["progress"] == {"stage": "decoding", "step": 1, "total": 1}
    assert completed["data"]["status"] == "succeeded"
    assert completed["data"]["outputs"][0]["url"]
    assert store.get(job_id).state == JobState.SUCCEEDED


def test_paused_and_resumed_webhooks_report_the_job_as_it_was_then(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    store, producer = deps.store, RecordingProducer()
    send: Any = producer
    job_id = webhook_job(store, receiver.url, ["paused", "resumed"])
    store.pause(job_id)
    assert enqueue_webhook_events(store, job_id, "paused", app=send)
    store.resume(job_id)
    assert enqueue_webhook_events(store, job_id, "resumed", app=send)
    assert enqueue_webhook_events(store, job_id, "succeeded", app=send) is None  # not asked
    drive_to_success(store, job_id)  # sent after the job ran on: each says what it was then
    for delivery in producer.deliveries():
        assert deliver_once(deps, delivery) is None
    paused, resumed = (verify(hit) for hit in receiver.hits)
    assert (paused["type"], paused["data"]["status"]) == ("job.paused", "paused")
    assert paused["seq"] == event_of(store, job_id, "paused").seq
    assert (resumed["type"], resumed["data"]["status"]) == ("job.resumed", "queued")
    assert resumed["seq"] == event_of(store, job_id, "resumed").seq


# --- a real webhooks worker -------------------------------------------------------------------


@dataclass
class WebhookWorld:
    storage_settings: StorageSettings
    store: JobStore
    celery: Any


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookWorld]:
    """A `kiln worker` (webhooks only: Celery threads pool) on its own namespace."""
    redis_url = TEST_REDIS_URL
    namespace = f"kiln-test-wh-{secrets.token_hex(4)}"
    outputs = tmp_path_factory.mktemp("outputs")
    env = {
        **os.environ,
        "KILN_REDIS_URL": redis_url,
        "KILN_REDIS_NAMESPACE": namespace,
        "KILN_STORAGE_URL": f"file://{outputs}",
        "KILN_WEBHOOK_SECRET": WEBHOOK_SECRET,
        "KILN_WEBHOOK_ALLOW_HTTP": "true",
        "KILN_WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
        "KILN_WEBHOOK_RETRY_SCHEDULE_S": "0.3,0.3,0.3",
        "KILN_WEBHOOK_RETRY_JITTER": "0",
    }
    log = (tmp_path_factory.mktemp("worker") / "worker.log").open("wb")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from kiln.tasks.cli.main import main; raise SystemExit(main())",
            "worker",
            "--concurrency=2",
            "--loglevel=INFO",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    storage_settings = StorageSettings(
        redis_url=redis_url, redis_namespace=namespace, storage_url=f"file://{outputs}"
    )
    store = JobStore.from_settings(storage_settings)
    try:
        yield WebhookWorld(
            storage_settings, store, make_celery_app(api_settings(), storage_settings)
        )
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
        log.close()
        delete_namespace(redis_url, namespace)


def wait_for_attempts(store: JobStore, job_id: str, count: int, timeout: float = 120) -> list[Any]:
    return wait_until(
        lambda: store.webhook_attempts(job_id),
        lambda attempts: len(attempts) >= count,
        timeout_s=timeout,
        what=f"{count} webhook attempts",
    )


def broker_messages(world: WebhookWorld, job_id: str) -> list[str]:
    """The webhook messages of `job_id` in the broker: queued, or taken and not yet acked."""
    options = transport_options(api_settings(), world.storage_settings.redis_namespace)
    keyprefix = str(options["global_keyprefix"])
    redis = world.store.redis
    queued = redis.lrange(keyprefix + WEBHOOKS_QUEUE, 0, -1)
    taken = redis.hvals(keyprefix + "unacked")  # kombu's ack emulation (tasks/control/unacked.py)
    return [message for message in [*queued, *taken] if job_id in message]


def test_worker_retries_until_delivered_with_one_webhook_id(world: WebhookWorld) -> None:
    failures = 2
    receiver = Receiver(script=[500] * failures)
    try:
        job_id = webhook_job(world.store, receiver.url)
        drive_to_success(world.store, job_id)
        assert enqueue_webhook_events(world.store, job_id, "succeeded", app=world.celery)
        hits = receiver.wait_for(failures + 1, timeout=120)
        attempts = wait_for_attempts(world.store, job_id, failures + 1)
        # no message of the job is left in the broker, queued or taken: none can deliver again
        wait_until(lambda: broker_messages(world, job_id), lambda left: not left)
        assert len(receiver.hits) == failures + 1
        assert {h.headers["webhook-id"] for h in hits} == {f"msg_{job_id}_completed"}
        assert len({h.body for h in hits}) == 1  # every retry resends the first body
        assert all(verify(h)["data"]["status"] == "succeeded" for h in hits)
        assert [a["outcome"] for a in attempts] == ["retrying", "retrying", "delivered"]
        assert [a["attempt"] for a in attempts] == [1, 2, 3]
    finally:
        receiver.close()


def test_dead_receiver_never_changes_the_outcome(world: WebhookWorld) -> None:
    dead = Receiver()
    url = dead.url
    dead.close()  # nothing listens there any more
    job_id = webhook_job(world.store, url)
    drive_to_success(world.store, job_id)
    assert enqueue_webhook_events(world.store, job_id, "succeeded", app=world.celery)
    attempts = wait_for_attempts(world.store, job_id, 4)
    assert [a["outcome"] for a in attempts] == ["retrying"] * 3 + ["gave_up"]
    assert all(a["status_code"] is None and a["error"] for a in attempts)
    assert world.store.get(job_id).state == JobState.SUCCEEDED


def test_a_retry_resends_the_first_body_byte_for_byte(world: WebhookWorld) -> None:
    """The job succeeds between attempts; every attempt still sends the first `started` body."""
    store = world.store
    receiver = Receiver(script=[500, 500])
    try:
        job_id = webhook_job(store, receiver.url, ["started"])
        token = start_job(store, job_id)

        def finish_on_first_hit(number: int) -> None:
            if number == 1:  # before the receiver answers, so before any retry is scheduled
                finish_with_success(store, job_id, token)

        receiver.on_hit = finish_on_first_hit
        webhook_id = enqueue_webhook_events(store, job_id, "started", app=world.celery)
        hits = receiver.wait_for(3, timeout=120)
        attempts = wait_for_attempts(store, job_id, 3)
        assert store.get(job_id).state == JobState.SUCCEEDED  # it did change in between
        assert {h.headers["webhook-id"] for h in hits} == {webhook_id}
        payloads = [verify(h) for h in hits]  # each signed over the same body, its own timestamp
        assert [p["data"]["status"] for p in payloads] == ["running"] * 3
        assert len({h.body for h in hits}) == 1
        assert payloads[0]["type"] == "job.started"
        assert payloads[0]["seq"] == event_of(store, job_id, "running").seq
        assert [a["outcome"] for a in attempts] == ["retrying", "retrying", "delivered"]
    finally:
        receiver.close()


def test_every_webhook_carries_its_event_seq(world: WebhookWorld) -> None:
    """`seq` names each webhook's event in the job's stream, increasing as the events happened."""
    store, app = world.store, world.celery
    receiver = Receiver()
    try:
        job_id = webhook_job(store, receiver.url, ["started", "progress", "completed"])
        token = start_job(store, job_id)
        ids = [enqueue_webhook_events(store, job_id, "started", app=app)]
        for step in (1, 2, 3):
            store.set_progress(job_id, token, {"stage": "denoising", "step": step, "total": 3})
            ids.append(
                enqueue_webhook_events(store, job_id, "progress", app=app, progress_interval_s=0)
            )
        finish_with_success(store, job_id, token, steps=0)
        ids.append(enqueue_webhook_events(store, job_id, "succeeded", app=app))
        hits = receiver.wait_for(len(ids), timeout=120)
        seq_of = {h.headers["webhook-id"]: verify(h)["seq"] for h in hits}
        seqs = [seq_of[webhook_id] for webhook_id in ids if webhook_id is not None]
        assert seqs == [e.seq for e in store.events(job_id) if e.type != "queued"]
        assert all(a < b for a, b in itertools.pairwise(seqs))
    finally:
        receiver.close()


def test_progress_webhook_ids_are_distinct_across_stages(world: WebhookWorld) -> None:
    """Steps restart at 1 in each stage; a receiver deduplicating on webhook-id still gets all."""
    store, app = world.store, world.celery
    stages = [
        ("denoising", 1, 2),
        ("denoising", 2, 2),
        ("decoding", 1, 1),
        ("encoding", 1, 1),
        ("uploading", 1, 1),
    ]
    receiver = Receiver()
    try:
        job_id = webhook_job(store, receiver.url, ["progress"])
        token = start_job(store, job_id)
        ids = []
        for stage, step, total in stages:
            store.set_progress(job_id, token, {"stage": stage, "step": step, "total": total})
            ids.append(
                enqueue_webhook_events(store, job_id, "progress", app=app, progress_interval_s=0)
            )
        assert None not in ids
        assert len(set(ids)) == len(stages)
        hits = receiver.wait_for(len(stages), timeout=120)
        by_id = {h.headers["webhook-id"]: verify(h) for h in hits}
        assert len(by_id) == len(stages)
        assert [by_id[str(i)]["data"]["progress"]["stage"] for i in ids] == [s[0] for s in stages]
        finish_with_success(store, job_id, token, steps=0)
    finally:
        receiver.close()
