"""Batch lines in OpenAI's Batch form: `{"custom_id", "method", "url", "body"}`, body the request.

A file written for OpenAI's Batch API runs as it is: its `body` is the job request, `method`
must be POST and `url` /v1/jobs (else the line is refused with the form it must take), and each
result line carries the line's `custom_id`. Errors inside the request point into `body`.
"""

from __future__ import annotations

from typing import Any

import pytest

from kiln.tasks.batches.intake import batch_job_id
from kiln.tasks.contract.batches import OPENAI_LINE_SHAPE
from tests.tasks.helpers import Api
from tests.tasks.test_batches import (
    feeder,
    finish_queued,
    get_batch,
    jsonl,
    post_batch,
    results,
)

REQUEST = {"prompt": "waves", "width": 64, "height": 64, "steps": 2}


def openai_line(custom_id: str, **changes: Any) -> dict[str, Any]:
    """A line as OpenAI's Batch API takes it, asking for one job."""
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/jobs", "body": dict(REQUEST)}
    return {**line, **changes}


def only_line_error(api: Api, line: dict[str, Any]) -> dict[str, Any]:
    refused = post_batch(api, jsonl([line]), pipeline="tiny")
    assert refused.status_code == 422, refused.text
    (error,) = [error for error in refused.json()["detail"] if error["line"] == 1]
    return dict(error)


def test_openai_lines_run_beside_kiln_lines_and_keep_their_custom_ids(api: Api) -> None:
    wide = openai_line("oa-wide", body={**REQUEST, "width": 128, "seed": 7})
    lines = [openai_line("oa-1"), wide, {**REQUEST, "custom_id": "kiln-1"}]
    created = post_batch(api, jsonl(lines), pipeline="tiny")
    assert created.status_code == 201, created.text
    batch_id = created.json()["id"]
    feed, published = feeder(api)
    feed.tick()
    assert len(published.calls) == 3
    job = api.store.get(batch_job_id(batch_id, "oa-wide"))
    assert (job.request["width"], job.request["seed"], job.request["prompt"]) == (128, 7, "waves")
    finish_queued(api, batch_id)
    feed.tick()
    assert get_batch(api, batch_id)["outcome"] == "succeeded"
    finished = results(api, batch_id)[:-1]
    assert sorted((line["custom_id"], line["status"]) for line in finished) == [
        ("kiln-1", "succeeded"),
        ("oa-1", "succeeded"),
        ("oa-wide", "succeeded"),
    ]


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"method": "GET"}, "method", "method must be 'POST'; got 'GET'"),
        ({"url": "/v1/chat/completions"}, "url", "url must be '/v1/jobs'; got '/v1/chat/compl"),
        ({"body": "waves"}, "body", "body must be the job request object; got 'waves'"),
        ({"model": "tiny"}, "model", "'model' is not a key of a line in this form"),
    ],
)
def test_a_line_not_asking_for_post_v1_jobs_is_refused_with_the_form(
    api: Api, changes: dict[str, Any], field: str, reason: str
) -> None:
    error = only_line_error(api, openai_line("oa-1", **changes))
    assert error["type"] == "line_shape"
    assert error["loc"] == ["body", "line", 1, field]
    assert error["msg"].startswith(reason)
    assert error["msg"].endswith(f"; expected {OPENAI_LINE_SHAPE}")
    assert '"method": "POST", "url": "/v1/jobs", "body": {<job request>}' in error["msg"]


def test_a_line_without_method_says_the_form_too(api: Api) -> None:
    line = openai_line("oa-1")
    del line["method"]
    error = only_line_error(api, line)
    assert error["msg"] == f"method must be 'POST'; got nothing; expected {OPENAI_LINE_SHAPE}"


def test_errors_in_the_request_point_into_body(api: Api) -> None:
    schema = only_line_error(api, openai_line("oa-1", body={**REQUEST, "steps": 0}))
    assert schema["loc"] == ["body", "line", 1, "body", "steps"]
    limit = only_line_error(api, openai_line("oa-1", body={**REQUEST, "width": 2048}))
    assert (limit["type"], limit["loc"]) == ("pipeline_limit", ["body", "line", 1, "body", "width"])
    bound = only_line_error(api, openai_line("oa-1", body={**REQUEST, "width": 100000}))
    assert bound["msg"] == "tiny takes width ≤ 1024; got 100000"


def test_skip_invalid_makes_a_wrong_line_an_invalid_result_with_the_form(api: Api) -> None:
    lines = [openai_line("oa-1"), openai_line("oa-2", url="/v1/embeddings")]
    created = post_batch(api, jsonl(lines), pipeline="tiny", skip_invalid="true")
    assert created.status_code == 201, created.text
    batch_id = created.json()["id"]
    feed, _ = feeder(api)
    feed.tick()
    finish_queued(api, batch_id)
    feed.tick()
    by_id = {line["custom_id"]: line for line in results(api, batch_id)[:-1]}
    assert by_id["oa-1"]["status"] == "succeeded"
    assert by_id["oa-2"]["status"] == "invalid"
    assert OPENAI_LINE_SHAPE in by_id["oa-2"]["error"]["message"]
