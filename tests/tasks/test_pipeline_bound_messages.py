"""A value past the schema's global bound names the pipeline's own, lower limit.

`--width 100000` for a pipeline that takes 1024 used to quote the schema's 4096: a user who
then asked for 4096 was refused again. Every door says the pipeline's limit: POST /v1/jobs, a
batch line, and `kiln submit` (straight to Redis or through `--api`).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.main import EXIT_USAGE, main
from kiln.tasks.contract.limits import PipelineLimits
from tests.tasks.helpers import Api
from tests.tasks.test_batches import jsonl, post_batch
from tests.tasks.test_limits import announce, only_error, post_job


@pytest.mark.parametrize(
    ("body", "message", "limit"),
    [
        ({"pipeline": "tiny", "width": 100000}, "tiny takes width ≤ 1024; got 100000", "max_width"),
        ({"height": 8192}, "default takes height ≤ 1024; got 8192", "max_height"),
        ({"pipeline": "tiny", "steps": 1000}, "tiny takes steps ≤ 200; got 1000", "max_steps"),
        (
            {"pipeline": "tiny-video", "num_frames": 2001},
            "tiny-video takes num_frames = 4k+1 (1, 5, 9, …, 81); got 2001",
            "max_frames",
        ),
    ],
)
def test_the_api_names_the_pipelines_limit_past_the_schemas_bound(
    api: Api, body: dict[str, Any], message: str, limit: str
) -> None:
    error = only_error(post_job(api, body))
    assert error["msg"] == message
    assert error["type"] == "pipeline_limit"
    assert error["ctx"] == {"limit": limit, "pipeline": body.get("pipeline", "default")}
    assert error["loc"] == ["body", next(iter(set(body) - {"pipeline"}))]


def test_the_widest_live_node_is_named_and_a_pipeline_without_a_lower_limit_keeps_the_schemas(
    api: Api,
) -> None:
    announce(api, "small", {"custom": PipelineLimits(max_width=512)})
    announce(api, "large", {"custom": PipelineLimits(max_width=2048)})
    api.store.publish_node("old", {"pipelines": ["legacy"]}, ttl_s=30)  # declares no limits
    custom = only_error(post_job(api, {"pipeline": "custom", "width": 100000}))
    assert custom["msg"] == "custom takes width ≤ 2048; got 100000"
    legacy = only_error(post_job(api, {"pipeline": "legacy", "width": 100000}))
    assert legacy["type"] == "less_than_equal"
    assert legacy["msg"] == "Input should be less than or equal to 4096"


def test_other_errors_of_the_request_are_kept_beside_it(api: Api) -> None:
    response = httpx.post(
        f"{api.url}/v1/jobs",
        json={"pipeline": "tiny", "width": 100000, "guidance_scale": 99},
        headers=api.auth(),
    )
    assert response.status_code == 422
    by_field = {error["loc"][-1]: error for error in response.json()["detail"]}
    assert set(by_field) == {"prompt", "width", "guidance_scale"}
    assert by_field["width"]["msg"] == "tiny takes width ≤ 1024; got 100000"
    assert by_field["guidance_scale"]["type"] == "less_than_equal"  # no pipeline limit for it


def test_a_batch_line_names_the_pipelines_limit(api: Api) -> None:
    line = {"custom_id": "wide", "prompt": "waves", "width": 100000}
    refused = post_batch(api, jsonl([line]), pipeline="tiny")
    assert refused.status_code == 422, refused.text
    (error,) = [error for error in refused.json()["detail"] if error["line"] == 1]
    assert (error["line"], error["type"]) == (1, "pipeline_limit")
    assert error["msg"] == "tiny takes width ≤ 1024; got 100000"


def test_kiln_submit_names_the_pipelines_limit(
    storage_settings: StorageSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KILN_REDIS_URL", storage_settings.redis_url)
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", storage_settings.redis_namespace)
    monkeypatch.setenv("KILN_STORAGE_URL", storage_settings.storage_url)
    monkeypatch.delenv("KILN_API_URL", raising=False)
    assert main(["submit", "waves", "--width", "100000", "--steps", "1000"]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "kiln: invalid job: width: default takes width ≤ 1024; got 100000; "
        "steps: default takes steps ≤ 200; got 1000\n"
    )


def test_kiln_submit_through_the_api_names_the_pipelines_limit(
    api: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["submit", "waves", "--pipeline", "tiny", "--width", "100000"]
    remote = ["--api", api.url, "--api-key", api.keys["alice"]]
    assert main([*args, *remote]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "kiln: invalid job: width: tiny takes width ≤ 1024; got 100000\n"
    )
