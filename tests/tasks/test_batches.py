"""Batches over real HTTP and Redis: submit, validation by line, feeding, window, results, cancel.

No node runs here: a feeder is driven by hand (`tick`) with a recording publisher, and jobs are
moved through the real store as a node would move them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchFeeding, BatchStore
from kiln.tasks.batches.feeder import BatchFeeder
from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.cli.main import main
from kiln.tasks.client import KilnClient, ValidationFailed
from kiln.tasks.contract.batches import BatchResult, BatchSummary
from kiln.tasks.queue.submit import Submitter
from tests.storage.helpers import feeder_of
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, finish_with_success, start_job
from tests.tasks.test_inputs import announce
from tests.waiting import wait_until

LINE = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 2}


def jsonl(lines: Iterable[dict[str, Any] | str]) -> bytes:
    return b"".join(
        (line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines
    )


def lines_of(count: int, **extra: Any) -> list[dict[str, Any]]:
    return [{**LINE, **extra, "custom_id": f"item-{n:04d}"} for n in range(count)]


def post_batch(api: Api, body: bytes, who: str = "alice", **params: str) -> httpx.Response:
    return httpx.post(
        f"{api.url}/v1/batches",
        content=body,
        params=params,
        headers={**api.auth(who), "Content-Type": "application/x-ndjson"},
        timeout=60,
    )


class Published:
    """A publisher that records (job id, queue) instead of sending to Celery."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, job_id: str, queue: str, countdown: float = 0.0) -> None:
        assert countdown == 0.0
        self.calls.append((job_id, queue))


def feeder(api: Api, owner: str = "node-a", **settings: Any) -> tuple[BatchFeeder, Published]:
    published = Published()
    tuned = api.settings.model_copy(update={"batch_results_flush_s": 0.0, **settings})
    submitter = Submitter(api.store, tuned, publish=published)
    assert api.ctx.objects is not None
    return BatchFeeder(api.store, api.ctx.objects, submitter, tuned, owner), published


def results(api: Api, batch_id: str, who: str = "alice") -> list[dict[str, Any]]:
    answer = httpx.get(f"{api.url}/v1/batches/{batch_id}/results", headers=api.auth(who))
    assert answer.status_code == 200, answer.text
    return [json.loads(line) for line in answer.text.splitlines() if line.strip()]


def get_batch(api: Api, batch_id: str, who: str = "alice") -> dict[str, Any]:
    answer = httpx.get(f"{api.url}/v1/batches/{batch_id}", headers=api.auth(who))
    assert answer.status_code == 200, answer.text
    view: dict[str, Any] = answer.json()
    return view


def finish_queued(api: Api, batch_id: str, fail: bool = False) -> int:
    """Run every queued job of the batch to success (or failure); returns how many."""
    queued = [
        job_id
        for job_id, _ in BatchFeeding(api.store.redis, api.store.settings).open_items(batch_id)
        if api.store.get(job_id).state == JobState.QUEUED
    ]
    for job_id in queued:
        if fail:
            token = start_job(api.store, job_id)
            api.store.fail(
                job_id, token, {"type": "JobFailed", "message": "no", "retryable": False}
            )
        else:
            drive_to_success(api.store, job_id)
    return len(queued)


def test_a_batch_is_fed_and_every_line_gets_one_result(api: Api) -> None:
    created = post_batch(api, jsonl(lines_of(5)), pipeline="tiny", metadata='{"team": "x"}')
    assert created.status_code == 201, created.text
    view = created.json()
    assert view["status"] == "running"
    assert view["counts"]["total"] == view["counts"]["pending"] == 5
    assert view["priority"] == "bulk"
    assert view["metadata"] == {"team": "x"}
    batch_id = view["id"]
    feed, published = feeder(api)
    feed.tick()
    assert len(published.calls) == 5
    assert {queue for _, queue in published.calls} == {"bulk.tiny"}
    job = api.store.get(batch_job_id(batch_id, "item-0002"))
    assert job.batch_id == batch_id
    assert job.request["seed"] is not None
    assert job.metadata == {"team": "x"}
    assert get_batch(api, batch_id)["counts"]["queued"] == 5
    finish_queued(api, batch_id)
    feed.tick()  # results of the finished jobs, then the end of the batch
    done = get_batch(api, batch_id)
    assert done["status"] == "completed"
    assert done["outcome"] == "succeeded"
    assert done["counts"]["succeeded"] == 5
    assert done["finished_at"] is not None
    assert done["throughput_per_s"] is not None
    lines = results(api, batch_id)
    assert [line["type"] for line in lines] == ["result"] * 5 + ["summary"]
    assert sorted(line["custom_id"] for line in lines[:-1]) == [f"item-{n:04d}" for n in range(5)]
    assert {line["status"] for line in lines[:-1]} == {"succeeded"}
    assert all(line["outputs"][0]["url"] and line["outputs"][0]["sha256"] for line in lines[:-1])
    assert sorted(line["line"] for line in lines[:-1]) == [1, 2, 3, 4, 5]
    assert lines[-1]["batch"]["status"] == "completed"


def test_duplicate_custom_ids_are_refused_with_their_lines(api: Api) -> None:
    body = jsonl([*lines_of(3), {**LINE, "custom_id": "item-0001"}])
    refused = post_batch(api, body)
    assert refused.status_code == 422
    answer = refused.json()
    assert answer["invalid_lines"] == 1
    assert answer["lines"] == 4
    first, error = answer["detail"]
    assert first["type"] == "batch_invalid"
    assert error["type"] == "duplicate_custom_id"
    assert error["line"] == 4
    assert error["loc"] == ["body", "line", 4, "custom_id"]
    assert "line 2" in error["msg"]
    assert BatchStore(api.store.redis, api.store.settings).active_batch_ids() == []


def test_invalid_lines_are_refused_with_line_numbers_reasons_and_count(api: Api) -> None:
    body = jsonl(
        [
            {**LINE, "custom_id": "ok-1"},
            {**LINE, "custom_id": "big", "width": 4000},  # over the tiny limits
            "not json",
            "",  # blank: skipped, still counted for line numbers
            {**LINE, "custom_id": "bad/id"},
            {**LINE, "custom_id": "nan", "guidance_scale": "NaN"},
            {**LINE},  # no custom_id
            {**LINE, "custom_id": "ok-2", "pipeline": "nope"},
            '{"custom_id": "x", "prompt": "p", "steps": NaN}',
        ]
    )
    refused = post_batch(api, body, pipeline="tiny")
    assert refused.status_code == 422
    answer = refused.json()
    assert answer["invalid_lines"] == 7
    assert answer["lines"] == 8
    by_line = {e["line"]: e for e in answer["detail"][1:]}
    assert sorted(by_line) == [2, 3, 5, 6, 7, 8, 9]
    assert by_line[2]["type"] == "pipeline_limit"
    assert by_line[2]["loc"] == ["body", "line", 2, "width"]
    assert by_line[3]["type"] == "json_invalid"
    assert by_line[5]["type"] == "custom_id"
    assert by_line[7]["type"] == "missing"
    assert by_line[8]["type"] == "unknown_pipeline"
    assert by_line[9]["type"] == "finite_number"


def test_skip_invalid_runs_the_valid_lines_and_reports_the_rest(api: Api) -> None:
    body = jsonl([*lines_of(2), {**LINE, "custom_id": "wide", "width": 4000}, "[1]"])
    created = post_batch(api, body, skip_invalid="true")
    assert created.status_code == 201, created.text
    batch_id = created.json()["id"]
    assert created.json()["counts"]["invalid"] == 2
    assert created.json()["counts"]["total"] == 4
    feed, _ = feeder(api)
    feed.tick()
    finish_queued(api, batch_id)
    feed.tick()
    lines = results(api, batch_id)
    invalid = [line for line in lines if line.get("status") == "invalid"]
    assert sorted((line["line"], line["custom_id"]) for line in invalid) == [(3, "wide"), (4, None)]
    assert invalid[0]["error"]["type"] == "invalid_line"
    assert len(lines) == 5
    assert lines[-1]["batch"]["outcome"] == "partial"


def test_skip_invalid_still_refuses_a_file_with_no_valid_line(api: Api) -> None:
    refused = post_batch(
        api, jsonl(["299", {**LINE, "custom_id": "wide", "width": 4000}]), skip_invalid="true"
    )
    assert refused.status_code == 422
    answer = refused.json()
    assert answer["invalid_lines"] == 2
    assert [e["type"] for e in answer["detail"]] == ["batch_invalid", "batch_no_valid_lines"]
    assert BatchStore(api.store.redis, api.store.settings).active_batch_ids() == []


def test_the_window_bounds_a_batchs_queued_and_running_jobs(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(10))).json()["id"]
    feed, published = feeder(api, batch_window=3)
    seen = []
    for _ in range(10):
        feed.tick()
        counts = get_batch(api, batch_id)["counts"]
        seen.append(counts["queued"] + counts["running"])
        if counts["pending"] == 0 and seen[-1] == 0:
            break
        finish_queued(api, batch_id)
    assert max(seen) == 3
    assert len(published.calls) == 10
    feed.tick()
    assert get_batch(api, batch_id)["status"] == "completed"
    assert len(results(api, batch_id)) == 11


def test_a_batch_whose_every_line_failed_is_completed_with_outcome_failed(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(3))).json()["id"]
    feed, _ = feeder(api)
    feed.tick()
    finish_queued(api, batch_id, fail=True)
    feed.tick()
    done = get_batch(api, batch_id)
    assert (done["status"], done["outcome"]) == ("completed", "failed")
    assert done["counts"]["failed"] == 3
    lines = results(api, batch_id)
    assert {line["status"] for line in lines[:-1]} == {"failed"}
    assert lines[0]["error"]["type"] == "JobFailed"


def test_a_feeder_that_dies_before_moving_its_cursor_is_redone_as_a_no_op(
    make_api: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = make_api(storage={"lease_ttl_s": 0.3})
    batch_id = post_batch(api, jsonl(lines_of(6))).json()["id"]
    first, first_published = feeder(api, "node-a", batch_window=4)

    def crash(*_args: object, **_kwargs: object) -> bool:
        raise RuntimeError("killed between creating the jobs and moving the cursor")

    monkeypatch.setattr(first.feeding, "record_fed", crash)
    first.tick()  # jobs of lines 1-4 exist; the cursor did not move, so none was published
    assert first_published.calls == []
    batches = BatchStore(api.store.redis, api.store.settings)
    assert batches.get_fed(batch_id).fed == 0
    second, second_published = feeder(api, "node-b", batch_window=4)
    second.tick()
    assert second_published.calls == []  # the lease is still node-a's
    feeding = BatchFeeding(api.store.redis, api.store.settings)
    wait_until(lambda: feeder_of(feeding, batch_id), lambda holder: holder is None)  # it lapses
    second.tick()
    assert feeder_of(feeding, batch_id) == "node-b"
    # the four jobs node-a made fill the window; the sweeper publishes them (as a node's does)
    assert batches.get_fed(batch_id).fed == 0
    for job_id in api.store.unpublished_jobs(0.0):
        second.submitter.publish(api.store.get(job_id))
    assert len(second_published.calls) == 4
    for n in range(4):
        drive_to_success(api.store, batch_job_id(batch_id, f"item-{n:04d}"))
    second.tick()
    # node-b fed lines 1-4 again: their jobs exist, so nothing was created or published
    assert batches.get_fed(batch_id).fed == 4
    assert len(second_published.calls) == 4
    for _ in range(5):
        finish_queued(api, batch_id)
        second.tick()
    assert get_batch(api, batch_id)["status"] == "completed"
    lines = results(api, batch_id)
    custom_ids = [line["custom_id"] for line in lines[:-1]]
    assert sorted(custom_ids) == [f"item-{n:04d}" for n in range(6)]
    assert [c for _, c in first_published.calls + second_published.calls].count("") == 0
    fed_ids = [job_id for job_id, _ in first_published.calls + second_published.calls]
    assert len(fed_ids) == len(set(fed_ids)) == 6  # each line's job created and published once
    for n in range(6):  # one creation event each
        events = api.store.latest_events(batch_job_id(batch_id, f"item-{n:04d}"))
        assert [e.payload.get("reason") for e in events if e.type == "queued"] == ["created"]


def test_cancel_stops_feeding_and_ends_every_line(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(8))).json()["id"]
    feed, _ = feeder(api, batch_window=3)
    feed.tick()  # 3 queued
    running = batch_job_id(batch_id, "item-0000")
    start_job(api.store, running)
    canceled = httpx.post(f"{api.url}/v1/batches/{batch_id}/cancel", headers=api.auth())
    assert canceled.status_code == 200
    assert canceled.json()["cancel_requested"] is True
    assert canceled.json()["status"] == "finalizing"
    feed.tick()
    assert api.store.get(batch_job_id(batch_id, "item-0001")).state == JobState.CANCELED
    assert api.store.cancel_requested(running)
    view = get_batch(api, batch_id)
    assert view["counts"]["pending"] == 0
    assert view["status"] == "finalizing"  # the running job has not stopped yet
    token = int(api.store.redis.hget(api.store.keys.job(running), "lease_token") or 0)
    api.store.finish_canceled(running, token)
    feed.tick()
    done = get_batch(api, batch_id)
    assert (done["status"], done["counts"]["canceled"]) == ("canceled", 8)
    lines = results(api, batch_id)
    assert len(lines) == 9
    assert {line["status"] for line in lines[:-1]} == {"canceled"}
    assert sum(1 for line in lines[:-1] if line["job_id"] is None) == 5  # never fed


def test_batches_belong_to_their_key(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(1))).json()["id"]
    other = httpx.get(f"{api.url}/v1/batches/{batch_id}", headers=api.auth("bob"))
    assert other.status_code == 403
    assert httpx.get(f"{api.url}/v1/batches/nope", headers=api.auth()).status_code == 404
    post_batch(api, jsonl(lines_of(1)), who="bob")
    mine = httpx.get(f"{api.url}/v1/batches", headers=api.auth()).json()
    assert [b["id"] for b in mine["batches"]] == [batch_id]
    everyone = httpx.get(f"{api.url}/v1/batches", headers=api.auth("admin")).json()
    assert len(everyone["batches"]) == 2
    page = httpx.get(f"{api.url}/v1/batches?limit=1", headers=api.auth("admin")).json()
    assert len(page["batches"]) == 1
    assert page["next_cursor"]


def test_a_batch_body_over_its_limit_is_413(make_api: ApiFactory) -> None:
    api = make_api(max_batch_bytes=4096)
    body = jsonl(lines_of(100))
    assert len(body) > 4096
    assert post_batch(api, body).status_code == 413

    def chunks() -> Iterable[bytes]:  # no Content-Length: counted as it streams
        yield body

    answer = httpx.post(f"{api.url}/v1/batches", content=chunks(), headers=api.auth(), timeout=30)
    assert answer.status_code == 413
    # the job route keeps its own, small limit
    assert post_batch(api, jsonl(lines_of(2))).status_code == 201


def test_bad_batch_options_are_422(api: Api) -> None:
    body = jsonl(lines_of(1))
    assert post_batch(api, body, completion_window="1y").status_code == 422
    assert post_batch(api, body, metadata="[1]").status_code == 422
    assert post_batch(api, body, unknown="1").status_code == 422
    assert post_batch(api, b"\n\n").status_code == 422


def test_the_batch_webhook_and_metadata_are_defaults_of_its_lines(api: Api) -> None:
    body = jsonl([{**LINE, "custom_id": "a"}, {**LINE, "custom_id": "b", "metadata": {"t": "own"}}])
    hook = "http://127.0.0.1:9/hook"
    created = post_batch(api, body, webhook_url=hook, metadata='{"t": "x", "run": "1"}')
    assert created.status_code == 201, created.text
    batch_id = created.json()["id"]
    assert created.json()["webhook"]["url"] == hook
    feeder(api)[0].tick()
    first = api.store.get(batch_job_id(batch_id, "a"))
    assert first.request["webhook"]["url"] == hook
    assert first.metadata == {"t": "x", "run": "1"}
    assert api.store.get(batch_job_id(batch_id, "b")).metadata == {"t": "own", "run": "1"}
    refused = post_batch(api, body, webhook_url="http://10.0.0.1/hook")
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["type"] == "unsafe_url"


def test_the_client_and_the_cli_over_http(
    api: Api, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "batch.jsonl"
    path.write_bytes(jsonl(lines_of(3)))
    with KilnClient(api.url, api.keys["alice"]) as client:
        view = client.submit_batch(path, pipeline="tiny")
        assert view.counts.total == 3
        assert client.get_batch(view.id).status == "running"
        assert [b.id for b in client.list_batches().batches] == [view.id]
        streamed = client.submit_batch(iter(lines_of(2)), metadata={"via": "iterable"})
        assert streamed.metadata == {"via": "iterable"}
        with pytest.raises(ValidationFailed) as refused:
            client.submit_batch(iter([*lines_of(1), *lines_of(1)]))
        assert refused.value.detail[1]["line"] == 2
        feed, _ = feeder(api)
        feed.tick()
        finish_queued(api, view.id)
        feed.tick()
        assert client.wait_batch(view.id, timeout=10).outcome == "succeeded"
        lines = list(client.batch_results(view.id))
        assert [type(line) for line in lines] == [BatchResult] * 3 + [BatchSummary]
        assert client.cancel_batch(streamed.id).cancel_requested
    http = ["--api", api.url, "--api-key", api.keys["alice"]]
    out = tmp_path / "results.jsonl"
    assert main(["batch", "results", view.id, "-o", str(out), *http]) == 0
    assert len(out.read_text().splitlines()) == 4
    assert main(["batch", "status", view.id, "--json", *http]) == 0
    assert json.loads(capsys.readouterr().out)["outcome"] == "succeeded"
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(jsonl([*lines_of(2), {**LINE, "custom_id": "item-0000", "steps": 0}]))
    assert main(["batch", "submit", str(bad), *http]) == 2
    err = capsys.readouterr().err
    assert "line 3, custom_id: duplicate custom_id 'item-0000'" in err
    assert "1 of 3 lines are invalid" in err


def test_the_end_of_the_completion_window_expires_what_has_not_started(api: Api) -> None:
    batch_id = post_batch(api, jsonl(lines_of(6)), completion_window="1h").json()["id"]
    feed, _ = feeder(api, batch_window=3)
    feed.tick()
    running = batch_job_id(batch_id, "item-0000")
    token = start_job(api.store, running)
    api.store.redis.hset(api.store.keys.batch(batch_id), "deadline", "1.0")  # the window ends
    feed.tick()
    assert api.store.get(batch_job_id(batch_id, "item-0001")).state == JobState.EXPIRED
    assert get_batch(api, batch_id)["status"] == "finalizing"
    finish_with_success(api.store, running, token)  # a running job may still finish
    feed.tick()
    done = get_batch(api, batch_id)
    assert (done["status"], done["outcome"]) == ("expired", "partial")
    assert (done["counts"]["succeeded"], done["counts"]["expired"]) == (1, 5)
    statuses = sorted(line["status"] for line in results(api, batch_id)[:-1])
    assert statuses == ["expired"] * 5 + ["succeeded"]


def test_a_line_whose_inputs_no_node_takes_is_refused_as_post_jobs_would(api: Api) -> None:
    announce(api)  # a node serving `tiny` with its input schema
    body = jsonl(
        [
            {**LINE, "custom_id": "ok", "pipeline": "tiny"},
            {**LINE, "custom_id": "odd", "pipeline": "tiny", "inputs": {"clip_skipp": 1}},
        ]
    )
    refused = post_batch(api, body)
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"][1:]
    assert (error["line"], error["type"]) == (2, "unknown_input")
    assert error["loc"] == ["body", "line", 2, "inputs", "clip_skipp"]
