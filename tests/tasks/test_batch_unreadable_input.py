"""A batch whose input cannot be read fails after bounded retries, and cancel always ends.

A real feeder over real Redis, HTTP and object store (the input is removed from the store, as
when the API and the nodes see different stores): the batch fails with the reason in its view,
its event stream and its webhook; a cancel of such a batch reaches `canceled`.
"""

from __future__ import annotations

from pathlib import Path

from kiln.storage.job_store import JobStore
from kiln.storage.objects import open_object_store
from kiln.tasks.batches.feeder import BatchFeeder
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import Api, ApiFactory, Receiver
from tests.tasks.test_batches import (
    Published,
    feeder,
    finish_queued,
    get_batch,
    jsonl,
    lines_of,
    post_batch,
    results,
)
from tests.tasks.test_batches_control import control
from tests.tasks.test_batches_events import Listener, RecordingCelery, feeder_with
from tests.tasks.test_cli_habits import kiln


def lose_input(api: Api, batch_id: str) -> None:
    assert api.ctx.objects is not None
    input_key = api.store.redis.hget(api.store.keys.batch(batch_id), "input_key")
    assert input_key is not None
    api.ctx.objects.delete(input_key)


def test_a_batch_whose_input_cannot_be_read_fails_saying_why(
    make_api: ApiFactory, receiver: Receiver
) -> None:
    api = make_api(batch_progress_interval_s=0)
    params = {"webhook_url": receiver.url, "webhook_events": "completed"}
    batch_id = post_batch(api, jsonl(lines_of(5)), **params).json()["id"]
    listener = Listener(api, batch_id)
    listener.wait_for({"pending": 5})
    celery = RecordingCelery()
    feed = feeder_with(api, Published(), celery, batch_window=2, batch_input_retry_s=0)
    feed.tick()  # two lines fed
    lose_input(api, batch_id)
    finish_queued(api, batch_id)
    feed.tick()  # their results; the next read fails once: tried again
    assert get_batch(api, batch_id)["status"] == "running"
    for _ in range(3):
        feed.tick()  # fails again: the batch fails; its unread lines end; the end
    view = get_batch(api, batch_id)
    assert view["status"] == "failed", view
    assert "input cannot be read" in view["error"]
    assert "input.jsonl" in view["error"]
    assert (view["counts"]["succeeded"], view["counts"]["failed"]) == (2, 3)
    listener.thread.join(timeout=30)
    assert not listener.thread.is_alive(), "the stream ends with the batch"
    event, data = listener.frames[-1]
    assert (event, data["status"]) == ("batch.failed", "failed")
    assert "input cannot be read" in data["error"]
    ((_, hook),) = celery.sent  # the batch's one webhook: its end
    assert hook["event"] == "batch.failed"
    assert "input cannot be read" in hook["body"]
    waited = kiln(api, "batch", "wait", batch_id)  # the CLI's line says why, too
    assert waited.returncode == 1, waited
    assert f"kiln: batch {batch_id} failed: the batch's input cannot be read" in waited.stderr


def test_a_cancel_ends_a_batch_whose_input_cannot_be_read(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(4))).json()["id"]
    lose_input(api, batch_id)
    feed, _ = feeder(api, batch_input_retry_s=0)
    feed.tick()  # the first read fails
    canceled = control(api, batch_id, "cancel")
    assert canceled.status_code == 200, canceled.text
    for _ in range(4):
        feed.tick()
    view = get_batch(api, batch_id)
    assert (view["status"], view["counts"]["canceled"]) == ("canceled", 4), view
    assert "input cannot be read" in view["error"]


def test_a_feeder_whose_own_store_is_elsewhere_reads_the_batch_where_its_record_says(
    api: Api, tmp_path: Path
) -> None:
    # the first-hour defect: a node configured with another folder looked for the input under
    # its own and never started the batch; the record names the store the batch was written to
    batch_id = post_batch(api, jsonl(lines_of(3))).json()["id"]
    written_to = api.store.settings.storage_url
    assert api.store.redis.hget(api.store.keys.batch(batch_id), "storage_url") == written_to
    elsewhere = api.store.settings.model_copy(
        update={"storage_url": f"file://{tmp_path / 'another-folder'}"}
    )
    node_store = JobStore(api.store.redis, elsewhere)
    node_objects = open_object_store(elsewhere)
    tuned = api.settings.model_copy(update={"batch_results_flush_s": 0.0})
    published = Published()
    submitter = Submitter(node_store, tuned, publish=published)
    feed = BatchFeeder(node_store, node_objects, submitter, tuned, "node-elsewhere")
    feed.tick()  # all three lines fed: the input was read where the batch was written
    assert finish_queued(api, batch_id) == 3
    for _ in range(3):
        feed.tick()
    view = get_batch(api, batch_id)
    assert (view["status"], view["counts"]["succeeded"]) == ("completed", 3), view
    lines = [line for line in results(api, batch_id) if line["type"] == "result"]
    assert sorted(line["custom_id"] for line in lines) == [f"item-{n:04d}" for n in range(3)]
    assert not any((tmp_path / "another-folder").rglob("*.jsonl"))  # nothing written there
