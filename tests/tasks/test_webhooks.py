"""Webhooks: schedule math, one attempt at a time against a local receiver, and a real worker.

Signatures are verified with the `standardwebhooks` library, not Kiln's own code.
"""

from __future__ import annotations

import email.utils
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook

from storage.objects import open_object_store
from storage.settings import StorageSettings
from storage.status import JobState, JobStore
from tasks.app import make_celery_app
from tasks.schemas import JobRequest
from tasks.settings import KilnSettings
from tasks.webhook_delivery import (
    Delivery,
    WebhookDeps,
    deliver_once,
    parse_retry_after,
    retry_delay,
)
from tasks.webhooks import enqueue_webhook_events
from tests.conftest import delete_namespace
from tests.tasks.helpers import WEBHOOK_SECRET, Hit, Receiver, api_settings, drive_to_success
from tests.tasks.helpers import queued_job as make_queued_job

ROOT = Path(__file__).resolve().parents[2]


def verify(hit: Hit) -> dict[str, Any]:
    """The payload, after the standardwebhooks library checked the signature."""
    payload: dict[str, Any] = Webhook(WEBHOOK_SECRET).verify(hit.body, hit.headers)
    return payload


def webhook_job(store: JobStore, url: str, events: list[str] | None = None) -> str:
    request = JobRequest(
        prompt="p", width=64, height=64,
        webhook={"url": url, "events": events or ["completed"]},  # type: ignore[arg-type]
    )
    return make_queued_job(store, request)


# --- schedule math --------------------------------------------------------------------------


def test_retry_delay_follows_the_schedule_then_stops() -> None:
    rng = random.Random(1)
    delays = [retry_delay(n, [10, 60, 300], 0.0, rng) for n in (1, 2, 3, 4)]
    assert delays == [10.0, 60.0, 300.0, None]


def test_jitter_only_shortens_within_its_fraction() -> None:
    rng = random.Random(7)
    samples = [retry_delay(2, [10, 100], 0.2, rng) for _ in range(200)]
    assert all(s is not None and 80.0 <= s <= 100.0 for s in samples)
    assert len({round(s or 0, 3) for s in samples}) > 100  # spread out, not one value


def test_retry_after_is_a_lower_bound_with_a_cap() -> None:
    rng = random.Random(3)
    assert retry_delay(1, [10], 0.0, rng, retry_after=120) == 120.0
    assert retry_delay(1, [10], 0.0, rng, retry_after=2) == 10.0
    assert retry_delay(1, [10], 0.0, rng, retry_after=10**9, retry_after_max=3600) == 3600.0
    assert retry_delay(2, [10], 0.0, rng, retry_after=5) is None  # the schedule still ends


def test_parse_retry_after() -> None:
    now = time.time()
    assert parse_retry_after("120", now) == 120.0
    http_date = email.utils.formatdate(now + 30, usegmt=True)
    parsed = parse_retry_after(http_date, now)
    assert parsed is not None and 28 <= parsed <= 31
    assert parse_retry_after("soon", now) is None and parse_retry_after(None, now) is None


def test_default_schedule_spans_hours() -> None:
    schedule = KilnSettings().webhook_retry_schedule_s
    assert sum(schedule) > 6 * 3600 and schedule == sorted(schedule)


# --- one attempt at a time --------------------------------------------------------------------


@pytest.fixture
def deps(job_store: JobStore, storage_settings: StorageSettings) -> WebhookDeps:
    return WebhookDeps(api_settings(), job_store, open_object_store(storage_settings))


def test_delivered_signed_and_recorded(deps: WebhookDeps, receiver: Receiver) -> None:
    job_id = webhook_job(deps.store, receiver.url)
    drive_to_success(deps.store, job_id)
    delivery = Delivery(job_id, "completed", f"msg_{job_id}_completed")
    assert deliver_once(deps, delivery) is None
    payload = verify(receiver.hits[0])
    assert payload["type"] == "job.completed" and payload["data"]["id"] == job_id
    assert payload["data"]["status"] == "succeeded" and payload["data"]["outputs"][0]["url"]
    assert receiver.hits[0].headers["webhook-id"] == f"msg_{job_id}_completed"
    (attempt,) = deps.store.webhook_attempts(job_id)
    assert attempt["outcome"] == "delivered" and attempt["status_code"] == 200
    assert attempt["latency_ms"] > 0 and attempt["error"] is None


def test_failure_schedules_a_retry_honouring_retry_after(
    deps: WebhookDeps, receiver: Receiver
) -> None:
    receiver.script = [(503, {"Retry-After": "3"})]
    job_id = webhook_job(deps.store, receiver.url)
    before = time.time()
    following = deliver_once(deps, Delivery(job_id, "completed", "msg_x"))
    assert following is not None and following.attempt == 2 and following.webhook_id == "msg_x"
    assert following.not_before is not None and following.not_before >= before + 3
    (attempt,) = deps.store.webhook_attempts(job_id)
    assert attempt["outcome"] == "retrying" and attempt["status_code"] == 503
    assert attempt["next_attempt_at"] == following.not_before


def test_last_failure_gives_up(deps: WebhookDeps, receiver: Receiver) -> None:
    receiver.script = [500]
    job_id = webhook_job(deps.store, receiver.url)
    assert deliver_once(deps, Delivery(job_id, "completed", "msg_x", attempt=4)) is None
    assert deps.store.webhook_attempts(job_id)[-1]["outcome"] == "gave_up"


def test_410_stops_this_endpoint(deps: WebhookDeps, receiver: Receiver) -> None:
    receiver.script = [410]
    job_id = webhook_job(deps.store, receiver.url, ["started", "completed"])
    assert deliver_once(deps, Delivery(job_id, "started", "msg_a")) is None
    assert deliver_once(deps, Delivery(job_id, "completed", "msg_b")) is None
    assert len(receiver.hits) == 1
    assert [a["outcome"] for a in deps.store.webhook_attempts(job_id)] == ["gone"]


def test_redirects_are_not_followed(deps: WebhookDeps, receiver: Receiver) -> None:
    elsewhere = Receiver()
    try:
        receiver.script = [(307, {"Location": elsewhere.url})]
        job_id = webhook_job(deps.store, receiver.url)
        assert deliver_once(deps, Delivery(job_id, "completed", "msg_x")) is not None
        assert elsewhere.hits == [] and deps.store.webhook_attempts(job_id)[0]["status_code"] == 307
    finally:
        elsewhere.close()


def test_refused_at_delivery_when_not_allowed(
    job_store: JobStore, receiver: Receiver
) -> None:
    strict = WebhookDeps(api_settings(webhook_allow_hosts=[]), job_store, None)
    job_id = webhook_job(job_store, receiver.url)
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
        self.sent.append(SentTask(name, kwargs, queue))


def test_enqueue_filters_by_subscription_and_throttles_progress(job_store: JobStore) -> None:
    producer = RecordingProducer()
    job_id = webhook_job(job_store, "https://example.com/h", ["progress", "completed"])
    send: Any = producer
    assert enqueue_webhook_events(job_store, job_id, "running", app=send) is None  # not asked
    assert enqueue_webhook_events(job_store, job_id, "queued", app=send) is None
    first = enqueue_webhook_events(job_store, job_id, "progress", app=send, progress_interval_s=60)
    again = enqueue_webhook_events(job_store, job_id, "progress", app=send, progress_interval_s=60)
    assert first is not None and again is None
    done = enqueue_webhook_events(job_store, job_id, "succeeded", app=send)
    assert done == enqueue_webhook_events(job_store, job_id, "completed", app=send)
    assert [t.kwargs["event"] for t in producer.sent] == ["progress", "completed", "completed"]
    assert {t.queue for t in producer.sent} == {"webhooks"}
    assert {t.name for t in producer.sent} == {"kiln.deliver_webhook"}


# --- a real webhooks worker -------------------------------------------------------------------


@dataclass
class WebhookWorld:
    storage_settings: StorageSettings
    store: JobStore
    celery: Any


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookWorld]:
    """A `kiln worker` (webhooks only: Celery threads pool) on its own namespace."""
    redis_url = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
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
        [sys.executable, "-c", "from tasks.cli import main; raise SystemExit(main())",
         "worker", "--concurrency=2", "--loglevel=INFO"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        attempts = store.webhook_attempts(job_id)
        if len(attempts) >= count:
            return attempts
        time.sleep(0.05)
    raise AssertionError(f"{len(store.webhook_attempts(job_id))} attempts, expected {count}")


def test_worker_retries_until_delivered_with_one_webhook_id(world: WebhookWorld) -> None:
    failures = 2
    receiver = Receiver(script=[500] * failures)
    try:
        job_id = webhook_job(world.store, receiver.url)
        drive_to_success(world.store, job_id)
        assert enqueue_webhook_events(world.store, job_id, "succeeded", app=world.celery)
        hits = receiver.wait_for(failures + 1, timeout=120)
        attempts = wait_for_attempts(world.store, job_id, failures + 1)
        time.sleep(1.0)  # a fourth delivery would arrive by now (schedule: 0.3 s)
        assert len(receiver.hits) == failures + 1
        assert {h.headers["webhook-id"] for h in hits} == {f"msg_{job_id}_completed"}
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
