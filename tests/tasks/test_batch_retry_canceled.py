"""A canceled batch's lines can be retried like failed ones: the API, the client and the CLI.

A retry runs again every line that ended without succeeding unless told which: failed, expired
and canceled (lines a cancel stopped while queued, and those it kept from ever being fed).
"""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.storage.settings import StorageSettings
from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.cli.main import main
from kiln.tasks.client import KilnClient
from tests.tasks.helpers import Api, drive_to_success
from tests.tasks.test_batches import (
    feeder,
    finish_queued,
    get_batch,
    jsonl,
    lines_of,
    post_batch,
    results,
)
from tests.tasks.test_batches_control import control


def canceled_batch(api: Api) -> str:
    """A batch of 5 lines: line 1 succeeded, 2-3 canceled while queued, 4-5 never fed."""
    batch_id = str(post_batch(api, jsonl(lines_of(5)), pipeline="tiny").json()["id"])
    feed, _ = feeder(api, batch_window=3)
    feed.tick()  # lines 1-3 queued
    drive_to_success(api.store, batch_job_id(batch_id, "item-0000"))
    canceled = httpx.post(f"{api.url}/v1/batches/{batch_id}/cancel", headers=api.auth())
    assert canceled.status_code == 200, canceled.text
    feed.tick()
    feed.tick()
    view = get_batch(api, batch_id)
    assert (view["status"], view["counts"]["succeeded"], view["counts"]["canceled"]) == (
        "canceled",
        1,
        4,
    )
    return batch_id


def test_a_retry_runs_the_canceled_lines_again_by_default(api: Api) -> None:
    parent = canceled_batch(api)
    made = control(api, parent, "retry")
    assert made.status_code == 201, made.text
    retry = made.json()
    assert (retry["parent_id"], retry["counts"]["total"]) == (parent, 4)
    feed, published = feeder(api)
    feed.tick()
    assert len(published.calls) == 4
    queued = api.store.get(batch_job_id(retry["id"], "item-0004"))  # one never fed before
    assert queued.request["prompt"] == lines_of(5)[4]["prompt"]
    assert finish_queued(api, retry["id"]) == 4
    feed.tick()
    done = results(api, retry["id"])
    assert sorted(line["custom_id"] for line in done[:-1]) == [
        f"item-{n:04d}" for n in (1, 2, 3, 4)
    ]
    assert done[-1]["batch"]["outcome"] == "succeeded"
    again = control(api, parent, "retry", include="canceled")
    assert again.status_code == 201  # the first retry has ended: the lines may run once more


def test_include_canceled_alone_and_a_running_retry_holds_the_lines(api: Api) -> None:
    parent = canceled_batch(api)
    only = control(api, parent, "retry", include="canceled")
    assert only.status_code == 201, only.text
    assert only.json()["counts"]["total"] == 4
    held = control(api, parent, "retry", include="failed,canceled")
    assert (held.status_code, only.json()["id"] in held.json()["detail"]) == (409, True)
    nothing = control(api, parent, "retry", include="failed")
    assert (nothing.status_code, nothing.json()["detail"][0]["type"]) == (422, "nothing_to_retry")


def test_an_unknown_status_names_canceled_among_the_choices(api: Api) -> None:
    parent = canceled_batch(api)
    bad = control(api, parent, "retry", include="lost")
    assert bad.status_code == 422
    assert "'canceled'" in bad.json()["detail"][0]["msg"]


def test_the_client_retries_canceled_lines(api: Api) -> None:
    parent = canceled_batch(api)
    with KilnClient(api.url, api_key=api.keys["alice"]) as client:
        assert client.retry_batch(parent).counts.total == 4


@pytest.mark.parametrize("over_http", [False, True])
def test_kiln_batch_retry_retries_canceled_lines(
    api: Api,
    storage_settings: StorageSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    over_http: bool,
) -> None:
    parent = canceled_batch(api)
    monkeypatch.setenv("KILN_REDIS_URL", storage_settings.redis_url)
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", storage_settings.redis_namespace)
    monkeypatch.setenv("KILN_STORAGE_URL", storage_settings.storage_url)
    monkeypatch.delenv("KILN_API_URL", raising=False)
    http = ["--api", api.url, "--api-key", api.keys["alice"]] if over_http else []
    capsys.readouterr()
    assert main(["batch", "retry", parent, "--include", "canceled", "--json", *http]) == 0
    retry = json.loads(capsys.readouterr().out)
    assert (retry["parent_id"], retry["counts"]["total"]) == (parent, 4)
    assert main(["batch", "retry", parent, "--include", "lost", *http]) == 2
    assert "a comma-separated subset of failed,expired,canceled" in capsys.readouterr().err
