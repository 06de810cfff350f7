"""`POST /v1/batches` naming an upload (`POST /v1/uploads`), over real HTTP and the object store."""

from __future__ import annotations

from typing import Any

import httpx

from tests.tasks.helpers import Api
from tests.tasks.test_batches import LINE, feeder, jsonl, lines_of, results


def upload(api: Api, body: bytes, who: str = "alice") -> str:
    """Upload a batch file the way a client does: a slot, then the PUT; returns its ref."""
    slot = httpx.post(
        f"{api.url}/v1/uploads",
        json={"content_type": "application/x-ndjson", "bytes": len(body), "purpose": "batch"},
        headers=api.auth(who),
    )
    assert slot.status_code == 201, slot.text
    view = slot.json()
    put = httpx.put(view["url"], content=body, headers={**view["headers"], **api.auth(who)})
    assert put.status_code in (200, 204), put.text
    return str(view["ref"])


def submit(api: Api, body: dict[str, Any], who: str = "alice", **params: str) -> httpx.Response:
    return httpx.post(
        f"{api.url}/v1/batches", json=body, params=params, headers=api.auth(who), timeout=60
    )


def test_a_batch_from_an_upload_is_checked_and_fed_like_a_streamed_one(api: Api) -> None:
    lines = [*lines_of(2), {**LINE, "custom_id": "too-wide", "width": 40000}]
    ref = upload(api, jsonl(lines))
    options = {"pipeline": "tiny", "skip_invalid": True, "metadata": {"team": "x"}}
    created = submit(api, {"input_upload": ref, **options})
    assert created.status_code == 201, created.text
    view = created.json()
    assert (view["counts"]["total"], view["counts"]["invalid"]) == (3, 1)
    assert view["metadata"] == {"team": "x"}
    feed, published = feeder(api)
    feed.tick()
    assert {queue for _, queue in published.calls} == {"bulk.tiny"}
    assert len(published.calls) == 2
    assert [line["status"] for line in results(api, view["id"])] == ["invalid"]
    refused = submit(api, {"input_upload": ref})  # without skip_invalid: the file's 422
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["type"] == "batch_invalid"
    assert refused.json()["invalid_lines"] == 1


def test_an_upload_body_the_api_cannot_use_is_a_422_naming_the_field(api: Api) -> None:
    ref = upload(api, jsonl(lines_of(1)))
    cases = [
        (submit(api, {"input_upload": ref}, who="bob"), ["body", "input_upload"]),  # not bob's
        (submit(api, {"input_upload": "0" * 32}), ["body", "input_upload"]),
        (submit(api, {"input_upload": "../../etc"}), ["body", "input_upload"]),
        (submit(api, {"input_upload": ref, "colour": "red"}), ["body", "colour"]),
        (
            submit(api, {"input_upload": ref, "completion_window": "1y"}),
            ["body", "completion_window"],
        ),
        (submit(api, {"input_upload": ref}, pipeline="tiny"), ["query", "pipeline"]),
        (submit(api, {}), ["body", "input_upload"]),
    ]
    for answer, loc in cases:
        assert answer.status_code == 422, (loc, answer.text)
        assert answer.json()["detail"][0]["loc"] == loc, answer.text
    too_big = httpx.post(
        f"{api.url}/v1/batches",
        content=b'{"input_upload": "' + b"x" * 70_000 + b'"}',
        headers={**api.auth(), "Content-Type": "application/json"},
    )
    assert too_big.status_code == 413
