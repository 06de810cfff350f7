"""Steering batches over real HTTP and Redis: pause and resume, cancel against the feeder, retry.

No node runs here: a feeder is driven by hand (`tick`) with a recording publisher, and jobs are
moved through the real store as a node would move them (tests/tasks/test_batches.py).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kiln.common.states import JobState
from kiln.tasks.batches.intake import batch_job_id
from tests.tasks.helpers import Api, drive_to_success, start_job
from tests.tasks.test_batches import (
    feeder,
    finish_queued,
    get_batch,
    jsonl,
    lines_of,
    post_batch,
    results,
)


def control(api: Api, batch_id: str, action: str, **params: str) -> httpx.Response:
    return httpx.post(
        f"{api.url}/v1/batches/{batch_id}/{action}", params=params, headers=api.auth(), timeout=30
    )


def live(view: dict[str, Any]) -> int:
    return int(view["counts"]["queued"] + view["counts"]["running"])


def test_a_paused_batch_pauses_its_lines_and_feeds_again_once_resumed(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(8))).json()["id"]
    feed, published = feeder(api, batch_window=3)
    feed.tick()
    running = batch_job_id(batch_id, "item-0000")
    token = start_job(api.store, running)  # one line runs, two wait in the queue
    paused = control(api, batch_id, "pause")
    assert paused.status_code == 200, paused.text
    assert paused.json()["status"] == "paused"
    assert control(api, batch_id, "pause").json()["status"] == "paused"  # asked again: as it is
    view = get_batch(api, batch_id)
    # its queued lines are paused at once; its running one stops at its next step (its node)
    assert (view["counts"]["paused"], view["counts"]["running"], view["counts"]["queued"]) == (
        2,
        1,
        0,
    )
    assert api.store.pause_stopped(running, token).state == JobState.PAUSED  # what its node does
    feed.tick()  # nothing new is fed while paused
    view = get_batch(api, batch_id)
    assert (view["status"], live(view), view["counts"]["paused"]) == ("paused", 0, 3)
    assert view["counts"]["pending"] == 5
    assert len(published.calls) == 3
    resumed = control(api, batch_id, "resume")
    assert resumed.json()["status"] == "running"
    assert resumed.json()["counts"]["queued"] == 3  # its lines queued again
    for _ in range(4):
        feed.tick()
        finish_queued(api, batch_id)
    feed.tick()
    assert get_batch(api, batch_id)["status"] == "completed"
    assert len(published.calls) == 8
    assert len(results(api, batch_id)) == 9


def test_illegal_changes_are_409_naming_the_status(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(1))).json()["id"]
    feed, _ = feeder(api)
    refused = control(api, batch_id, "resume")  # running: nothing to resume, as it is
    assert (refused.status_code, refused.json()["status"]) == (200, "running")
    feed.tick()
    finish_queued(api, batch_id)
    feed.tick()
    for action in ("pause", "resume", "cancel"):
        answer = control(api, batch_id, action)
        assert answer.status_code == 409, (action, answer.text)
        assert "is completed" in answer.json()["detail"]
    assert control(api, "nope", "pause").status_code == 404
    other = httpx.post(f"{api.url}/v1/batches/{batch_id}/pause", headers=api.auth("bob"))
    assert other.status_code == 403


def test_a_cancel_landing_while_a_chunk_is_fed_publishes_none_of_it(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch_id = post_batch(api, jsonl(lines_of(5))).json()["id"]
    feed, published = feeder(api, batch_window=3)
    create_jobs = feed.store.create_jobs

    def create_then_cancel(*args: Any, **kwargs: Any) -> Any:
        created = create_jobs(*args, **kwargs)
        assert control(api, batch_id, "cancel").status_code == 200  # the race, made certain
        return created

    monkeypatch.setattr(feed.store, "create_jobs", create_then_cancel)
    feed.tick()
    assert published.calls == []  # the cursor move was refused: nothing went out
    assert get_batch(api, batch_id)["counts"]["pending"] == 5
    monkeypatch.undo()
    feed.tick()  # the wind-down finds the three jobs and cancels them, and ends the rest
    feed.tick()  # their results, then the end
    done = get_batch(api, batch_id)
    assert (done["status"], done["counts"]["canceled"]) == ("canceled", 5)
    for n in range(3):
        assert api.store.get(batch_job_id(batch_id, f"item-{n:04d}")).state == JobState.CANCELED
    lines = results(api, batch_id)
    assert sorted(line["custom_id"] for line in lines[:-1]) == [f"item-{n:04d}" for n in range(5)]
    assert published.calls == []


def test_retry_makes_a_linked_batch_of_the_failed_and_expired_lines(api: Api) -> None:
    parent = post_batch(api, jsonl(lines_of(6)), pipeline="tiny").json()["id"]
    feed, _ = feeder(api, batch_window=4)
    assert control(api, parent, "retry").status_code == 409  # still running
    feed.tick()  # lines 1-4 queued
    drive_to_success(api.store, batch_job_id(parent, "item-0000"))
    for n in (1, 2):
        token = start_job(api.store, batch_job_id(parent, f"item-{n:04d}"))
        error = {"type": "JobFailed", "message": "no", "retryable": False}
        api.store.fail(batch_job_id(parent, f"item-{n:04d}"), token, error)
    api.store.redis.hset(api.store.keys.batch(parent), "deadline", "1.0")  # the window ends
    feed.tick()
    feed.tick()
    assert get_batch(api, parent)["status"] == "expired"
    bad = control(api, parent, "retry", include="failed,lost")
    assert (bad.status_code, bad.json()["detail"][0]["loc"]) == (422, ["query", "include"])
    only_failed = control(api, parent, "retry", include="failed")
    assert only_failed.status_code == 201, only_failed.text
    retry = only_failed.json()
    assert (retry["parent_id"], retry["counts"]["total"], retry["status"]) == (parent, 2, "running")
    both = control(api, parent, "retry")  # the failed lines are being retried: not again
    assert (both.status_code, retry["id"] in both.json()["detail"]) == (409, True)
    expired = control(api, parent, "retry", include="expired").json()
    assert expired["counts"]["total"] == 3  # line 4 queued, 5-6 never fed
    assert get_batch(api, parent)["retries"] == [retry["id"], expired["id"]]
    feed.tick()
    job = api.store.get(batch_job_id(retry["id"], "item-0001"))
    assert job.request["seed"] == api.store.get(batch_job_id(parent, "item-0001")).request["seed"]
    assert finish_queued(api, retry["id"]) == 2
    feed.tick()
    done = results(api, retry["id"])
    assert sorted(line["custom_id"] for line in done[:-1]) == ["item-0001", "item-0002"]
    assert done[-1]["batch"]["outcome"] == "succeeded"


def test_a_paused_batch_canceled_cancels_its_paused_lines(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(4))).json()["id"]
    feed, _ = feeder(api, batch_window=2)
    feed.tick()
    assert get_batch(api, batch_id)["counts"]["queued"] == 2
    control(api, batch_id, "pause")
    assert get_batch(api, batch_id)["counts"]["paused"] == 2
    assert control(api, batch_id, "cancel").status_code == 200
    for _ in range(3):
        feed.tick()
    view = get_batch(api, batch_id)
    assert view["status"] == "canceled"
    assert (view["counts"]["paused"], view["counts"]["canceled"]) == (0, 4)
