"""Batch events over real HTTP and Redis: SSE (`/v1/batches/{id}/events`) and batch webhooks.

Webhook signatures are verified with the `standardwebhooks` library, not Kiln's own code; the
messages a feeder queues are recorded on their way to Celery and delivered to a local receiver.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import httpx
from standardwebhooks import Webhook

from kiln.tasks.batches.feeder import BatchFeeder
from kiln.tasks.queue.submit import Submitter
from kiln.tasks.webhooks.batch_hooks import (
    DELIVER_BATCH_WEBHOOK_TASK,
    BatchDelivery,
    deliver_batch_once,
)
from tests.tasks.helpers import WEBHOOK_SECRET, Api, ApiFactory, Receiver
from tests.tasks.test_batches import Published, finish_queued, jsonl, lines_of, post_batch
from tests.waiting import wait_until


class Listener:
    """Reads a batch's event stream in a thread, frame by frame."""

    def __init__(self, api: Api, batch_id: str) -> None:
        self.frames: list[tuple[str, dict[str, Any]]] = []
        self.url = f"{api.url}/v1/batches/{batch_id}/events"
        self.headers = api.auth()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        with httpx.stream("GET", self.url, headers=self.headers, timeout=60) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            event = ""
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    self.frames.append((event, json.loads(line.removeprefix("data: "))))

    def wait_for(self, counts: dict[str, int], timeout: float = 30.0) -> None:
        wait_until(
            lambda: list(self.frames),
            lambda frames: any(counts.items() <= view["counts"].items() for _, view in frames),
            timeout_s=timeout,
            poll_s=0.02,
            what=f"counts {counts}",
        )


def test_the_event_stream_sends_progress_then_ends_with_batch_failed(
    make_api: ApiFactory,
) -> None:
    api = make_api(batch_progress_interval_s=0)
    batch_id = post_batch(api, jsonl(lines_of(2))).json()["id"]
    listener = Listener(api, batch_id)
    listener.wait_for({"pending": 2})
    feed = feeder_with(api, Published())
    feed.tick()
    listener.wait_for({"queued": 2})
    finish_queued(api, batch_id, fail=True)
    feed.tick()
    listener.thread.join(timeout=30)
    assert not listener.thread.is_alive(), "the stream ends after the batch's end"
    events = [event for event, _ in listener.frames]
    assert events[0] == events[-2] == "batch.progress"
    assert events[-1] == "batch.failed"  # completed, none succeeded: never a silent success
    end = listener.frames[-1][1]
    assert (end["status"], end["outcome"], end["counts"]["failed"]) == ("completed", "failed", 2)


def test_progress_events_are_throttled(make_api: ApiFactory) -> None:
    api = make_api(batch_progress_interval_s=60)
    batch_id = post_batch(api, jsonl(lines_of(2))).json()["id"]
    listener = Listener(api, batch_id)
    listener.wait_for({"pending": 2})
    feed = feeder_with(api, Published())
    feed.tick()
    finish_queued(api, batch_id)
    feed.tick()
    listener.thread.join(timeout=30)
    assert [event for event, _ in listener.frames] == ["batch.progress", "batch.completed"]


class RecordingCelery:
    """Stands in for Celery's producer side (not Kiln's code): records what would be sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def send_task(self, name: str, kwargs: dict[str, Any], queue: str, **_: Any) -> None:
        assert queue == "webhooks"
        self.sent.append((name, json.loads(json.dumps(kwargs))))  # as Celery's JSON carries it


def feeder_with(api: Api, published: Published, app: Any = None, **settings: Any) -> BatchFeeder:
    tuned = api.settings.model_copy(update={"batch_results_flush_s": 0.0, **settings})
    submitter = Submitter(api.store, tuned, publish=published)
    assert api.ctx.objects is not None
    return BatchFeeder(api.store, api.ctx.objects, submitter, tuned, "node-a", app)


def test_batch_webhooks_are_signed_retried_with_one_body_and_say_failed(
    api: Api, receiver: Receiver
) -> None:
    params = {"webhook_url": receiver.url, "webhook_events": "progress,completed"}
    batch_id = post_batch(api, jsonl(lines_of(3)), **params).json()["id"]
    celery = RecordingCelery()
    feed = feeder_with(api, Published(), celery, batch_window=2, batch_progress_interval_s=0)
    feed.tick()  # two lines fed; none finished: no progress to report
    finish_queued(api, batch_id, fail=True)
    feed.tick()  # their results, the third line fed: progress
    finish_queued(api, batch_id, fail=True)
    feed.tick()  # the end
    batch_hooks = [kwargs for name, kwargs in celery.sent if name == DELIVER_BATCH_WEBHOOK_TASK]
    assert [hook["event"] for hook in batch_hooks] == ["batch.progress", "batch.failed"]
    assert batch_hooks[1]["webhook_id"] == f"msg_batch_{batch_id}_failed"
    receiver.script = [500]  # the first attempt fails: the retry sends the same bytes
    retry = deliver_batch_once(api.settings, BatchDelivery(**batch_hooks[1]))
    assert retry is not None
    assert retry.attempt == 2
    assert deliver_batch_once(api.settings, retry) is None
    assert deliver_batch_once(api.settings, BatchDelivery(**batch_hooks[0])) is None
    first, second, progress = receiver.wait_for(3)
    assert first.body == second.body
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    payload = Webhook(WEBHOOK_SECRET).verify(second.body, second.headers)
    assert (payload["type"], payload["data"]["id"]) == ("batch.failed", batch_id)
    assert (payload["data"]["status"], payload["data"]["outcome"]) == ("completed", "failed")
    assert payload["data"]["counts"]["failed"] == 3
    update = Webhook(WEBHOOK_SECRET).verify(progress.body, progress.headers)
    assert (update["type"], update["data"]["counts"]["failed"]) == ("batch.progress", 2)


def test_the_webhook_workers_app_knows_the_batch_webhook_task() -> None:
    # a fresh interpreter: the app must find the task through its own `include`, as
    # `celery worker` does, not because this test imported the module
    probe = (
        "from kiln.storage.settings import StorageSettings\n"
        "from kiln.tasks.contract.settings import KilnSettings\n"
        "from kiln.tasks.queue.app import make_celery_app\n"
        "app = make_celery_app(KilnSettings(), StorageSettings())\n"
        "app.loader.import_default_modules()\n"
        "print(sorted(name for name in app.tasks if name.startswith('kiln.')))\n"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert DELIVER_BATCH_WEBHOOK_TASK in found.stdout, found.stdout + found.stderr
