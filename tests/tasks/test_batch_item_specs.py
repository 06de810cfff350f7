"""A batch's item lines are job specs, fed as written, or refused by name when newer.

The previous release's (unversioned) lines feed as they were written; lines a newer release wrote
(a higher version) fail the batch by name, no job made. A real feeder over real Redis, HTTP and
object store; the stored input is rewritten in place, as another release would have written it.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.contract.job_spec import JobSpec
from tests.tasks.helpers import Api
from tests.tasks.test_batches import feeder, get_batch, jsonl, lines_of, post_batch


def stored_lines(api: Api, batch_id: str) -> tuple[str, list[dict[str, Any]]]:
    """The batch's input key and its item lines, parsed."""
    assert api.ctx.objects is not None
    key = api.store.redis.hget(api.store.keys.batch(batch_id), "input_key")
    assert key is not None
    raw = api.ctx.objects.get(key)
    return key, [json.loads(line) for line in raw.splitlines() if line.strip()]


def rewrite(api: Api, key: str, items: list[dict[str, Any]]) -> None:
    """Replace the stored input with `items` (same lines, same order)."""
    assert api.ctx.objects is not None
    api.ctx.objects.delete(key)
    body = b"".join(json.dumps(item, separators=(",", ":")).encode() + b"\n" for item in items)
    api.ctx.objects.put(key, body, "application/x-ndjson")


def test_the_item_lines_hold_the_spec_the_job_record_stores(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(3))).json()["id"]
    _, items = stored_lines(api, batch_id)
    assert {item["r"]["version"] for item in items} == {1}
    feed, _ = feeder(api)
    feed.tick()
    for item in items:
        record = api.store.get(batch_job_id(batch_id, item["c"]))
        assert record.request == item["r"]  # the same encoding, seed included
        assert JobSpec.decode(record.request) == JobSpec.decode(item["r"])


def test_unversioned_item_lines_of_the_previous_release_feed_as_written(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(3))).json()["id"]
    key, items = stored_lines(api, batch_id)
    old = [{**item, "r": {k: v for k, v in item["r"].items() if k != "version"}} for item in items]
    rewrite(api, key, old)
    feed, published = feeder(api)
    feed.tick()
    assert len(published.calls) == 3
    for item in old:
        record = api.store.get(batch_job_id(batch_id, item["c"]))
        assert record.request == {**item["r"], "version": 1}  # decoded as version 1
    assert get_batch(api, batch_id)["status"] != "failed"


def test_item_lines_of_a_newer_version_fail_the_batch_naming_it(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(3))).json()["id"]
    key, items = stored_lines(api, batch_id)
    rewrite(api, key, [{**item, "r": {**item["r"], "version": 3}} for item in items])
    feed, published = feeder(api)
    for _ in range(3):
        feed.tick()
    view = get_batch(api, batch_id)
    assert view["status"] == "failed", view
    assert "a line of the batch's input cannot be read" in view["error"]
    assert "version 3, newer than this release" in view["error"]
    assert published.calls == []
    assert view["counts"]["failed"] == 3  # its unread lines ended
