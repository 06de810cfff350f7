"""Pipeline limits at submit: the API's 422 naming the limit, the Submitter's and the CLI's refusal.

Real uvicorn and the real store in Redis. Before any node announces a built-in pipeline the
static limits of its name apply; a node's heartbeat (`limits`, per pipeline) replaces them.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.main import EXIT_USAGE, main
from kiln.tasks.contract.limits import PipelineLimits
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.intake.refusal import Refused
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import Api, api_settings, write_many

SMALL = {"prompt": "waves", "width": 64, "height": 64, "steps": 2}
FRAME_RULE = "tiny-video takes num_frames = 4k+1 (1, 5, 9, …, 81); got 16"


def post_job(api: Api, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={**SMALL, **body}, headers=api.auth())


def only_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    return dict(error)


def announce(api: Api, node_id: str, limits: dict[str, PipelineLimits]) -> None:
    """A node heartbeat as `Node.health()` writes it: pipelines and their limits."""
    info = {"pipelines": sorted(limits), "limits": {n: v.to_dict() for n, v in limits.items()}}
    api.store.publish_node(node_id, info, ttl_s=30)


@pytest.mark.parametrize(
    ("body", "loc", "limit", "message"),
    [
        ({"pipeline": "tiny", "width": 2048}, ["body", "width"], "max_width", "width ≤ 1024"),
        ({"pipeline": "tiny", "height": 2048}, ["body", "height"], "max_height", "height ≤ 1024"),
        (
            {"pipeline": "tiny-video", "width": 72},
            ["body", "width"],
            "size_multiple",
            "width as a multiple of 16",
        ),
        ({"pipeline": "tiny", "steps": 300}, ["body", "steps"], "max_steps", "steps ≤ 200"),
        (
            {"pipeline": "tiny-video", "num_frames": 16},
            ["body", "num_frames"],
            "frame_step",
            "4k+1",
        ),
        ({"pipeline": "tiny-video", "num_frames": 85}, ["body", "num_frames"], "max_frames", "81"),
        (
            {"pipeline": "tiny", "num_frames": 9},
            ["body", "num_frames"],
            "max_frames",
            "num_frames = 1 (an image pipeline)",
        ),
        (
            {"pipeline": "tiny-video", "width": 512, "height": 512, "num_frames": 81},
            ["body"],
            "max_pixels_frames_outputs",
            "512 × 512 × 81 × 1 = 21,233,664",
        ),
        (  # `default` is the tiny image pipeline until a node says otherwise
            {"width": 1024, "height": 1024, "num_outputs": 16},
            ["body"],
            "max_pixels_frames_outputs",
            "width × height × num_frames × num_outputs ≤ 4,194,304",
        ),
    ],
)
def test_api_refuses_a_request_over_a_limit_naming_it(
    api: Api, body: dict[str, Any], loc: list[str], limit: str, message: str
) -> None:
    error = only_error(post_job(api, body))
    assert error["loc"] == loc
    assert error["type"] == "pipeline_limit"
    assert error["ctx"]["limit"] == limit
    assert message in error["msg"]


def test_tiny_video_takes_4k_plus_1_frames(api: Api) -> None:
    refused = only_error(post_job(api, {"pipeline": "tiny-video", "num_frames": 16}))
    assert refused["msg"] == FRAME_RULE
    accepted = post_job(api, {"pipeline": "tiny-video", "num_frames": 17})
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["parameters"]["num_frames"] == 17


def test_announced_limits_come_from_node_heartbeats(api: Api) -> None:
    announce(api, "node-a", {"custom": PipelineLimits(max_steps=10, frame_step=8)})
    # A node's limits replace the static ones of a built-in name: this one takes 2048 pixels.
    announce(api, "node-b", {"tiny": PipelineLimits(max_width=2048, max_frames=1)})
    over = only_error(post_job(api, {"pipeline": "custom", "steps": 11}))
    assert (over["loc"], over["ctx"]) == (
        ["body", "steps"],
        {"limit": "max_steps", "pipeline": "custom"},
    )
    assert over["msg"] == "custom takes steps ≤ 10; got 11"
    frames = only_error(post_job(api, {"pipeline": "custom", "num_frames": 5}))
    assert frames["msg"] == "custom takes num_frames = 8k+1 (1, 9, 17, …, 1017); got 5"
    assert post_job(api, {"pipeline": "custom", "steps": 10, "num_frames": 9}).status_code == 201
    assert post_job(api, {"pipeline": "tiny", "width": 2048}).status_code == 201


def test_a_request_any_live_node_takes_is_accepted(api: Api) -> None:
    announce(api, "small", {"custom": PipelineLimits(max_width=512)})
    announce(api, "large", {"custom": PipelineLimits(max_width=1024)})
    # A node that announces no limits (an older one) takes what the job schema allows.
    api.store.publish_node("old", {"pipelines": ["legacy"]}, ttl_s=30)
    assert post_job(api, {"pipeline": "custom", "width": 1024}).status_code == 201
    error = only_error(post_job(api, {"pipeline": "custom", "width": 1032}))
    assert error["ctx"]["limit"] == "max_width"
    assert post_job(api, {"pipeline": "legacy", "width": 4096, "steps": 500}).status_code == 201


def test_submitter_refuses_for_python_callers(job_store: JobStore) -> None:
    published: list[str] = []
    submitter = Submitter(job_store, api_settings(), lambda job_id, *_: published.append(job_id))
    intake = Intake(submitter, None)
    with pytest.raises(Refused) as refused:
        intake.submit(JobRequest(pipeline="tiny-video", prompt="waves", num_frames=16))
    error = refused.value.refusal
    assert (error.code, error.loc) == ("pipeline_limit", ("num_frames",))
    assert error.message == FRAME_RULE
    assert error.context["limit"] == "frame_step"
    good = JobRequest(pipeline="tiny-video", prompt="waves", width=64, height=64, num_frames=17)
    bad = good.model_copy(update={"steps": 201})
    with pytest.raises(Refused) as in_bulk:
        write_many(intake, [good, bad])
    assert in_bulk.value.refusal.loc == ("steps",)
    assert published == []
    assert job_store.queue_depth() == 0


def test_cli_refuses_the_readme_video_example(
    storage_settings: StorageSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KILN_REDIS_URL", storage_settings.redis_url)
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", storage_settings.redis_namespace)
    monkeypatch.setenv("KILN_STORAGE_URL", storage_settings.storage_url)
    args = ["submit", "waves", "--pipeline", "tiny-video", "--frames", "16", "--format", "mp4"]
    code = main(args)
    assert code == EXIT_USAGE
    assert capsys.readouterr().err.strip() == f"kiln: invalid job: num_frames: {FRAME_RULE}"
