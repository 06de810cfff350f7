"""Preview limits a pipeline declares: shown with its other limits, a request over them refused.

Real uvicorn and the real store in Redis. `preview.max_side` is bounded by the pipeline's
`max_preview_side` and `preview.every_steps` by its `min_preview_every_steps`: the API answers a
422 of type `pipeline_limit` naming the field and the limit, a batch line the same at its line,
the Submitter a ValidationError, and a node refuses the job (`PipelineLimits.violation` on the
rank-side request).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import httpx
import pytest

from kiln.common.limits import LIMIT_KEYS, TINY_LIMITS, DeclaredLimits
from kiln.common.previews import MAX_PREVIEW_SIDE
from kiln.gpu_worker.limits import declared_limits
from kiln.gpu_worker.protocol import GenerationRequest, PreviewSpec
from kiln.storage.job_store import JobStore
from kiln.tasks.contract.limits import PipelineLimits
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.intake.refusal import Refused
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import Api, api_settings

SMALL = {"prompt": "waves", "width": 64, "height": 64, "steps": 4}
TINY_PREVIEW_SIDE = TINY_LIMITS["tiny"]["max_preview_side"]


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


def pipeline_limits(api: Api, name: str) -> dict[str, Any]:
    answer = httpx.get(f"{api.url}/v1/pipelines/{name}", headers=api.auth())
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["limits"])


def test_the_tiny_pipelines_declare_preview_limits_below_the_schema_range() -> None:
    assert {"max_preview_side", "min_preview_every_steps"} <= LIMIT_KEYS
    for name, declared in TINY_LIMITS.items():
        assert declared["max_preview_side"] < MAX_PREVIEW_SIDE, name
        assert declared["min_preview_every_steps"] >= 1, name


def test_a_pipeline_may_declare_preview_limits_on_its_ranks() -> None:
    class Declaring:
        def limits(self) -> DeclaredLimits:
            return DeclaredLimits(max_preview_side=128, min_preview_every_steps=5)

    declared = declared_limits(Declaring())
    assert PipelineLimits.from_dict(declared) == PipelineLimits(
        max_preview_side=128, min_preview_every_steps=5
    )


def test_the_pipeline_route_shows_the_preview_limits(api: Api) -> None:
    # announced before the first read: what nodes serve is read once per short interval
    strict = PipelineLimits(max_preview_side=64, min_preview_every_steps=4)
    announce(api, "node-a", {"custom": strict})
    # a node announcing no preview limits: the schema's own range
    api.store.publish_node("old", {"pipelines": ["legacy"], "limits": {"legacy": {}}}, ttl_s=30)
    tiny = pipeline_limits(api, "tiny")
    assert tiny["max_preview_side"] == TINY_PREVIEW_SIDE
    assert tiny["min_preview_every_steps"] == 1
    custom = pipeline_limits(api, "custom")
    assert (custom["max_preview_side"], custom["min_preview_every_steps"]) == (64, 4)
    legacy = pipeline_limits(api, "legacy")
    assert (legacy["max_preview_side"], legacy["min_preview_every_steps"]) == (MAX_PREVIEW_SIDE, 1)


def test_a_preview_larger_than_the_pipeline_takes_is_refused_naming_field_and_limit(
    api: Api,
) -> None:
    over = TINY_PREVIEW_SIDE + 8
    error = only_error(post_job(api, {"pipeline": "tiny", "preview": {"max_side": over}}))
    assert error["type"] == "pipeline_limit"
    assert error["loc"] == ["body", "preview", "max_side"]
    assert error["ctx"] == {"limit": "max_preview_side", "pipeline": "tiny"}
    assert error["msg"] == f"tiny takes preview.max_side ≤ {TINY_PREVIEW_SIDE}; got {over}"
    assert error["input"] == over
    at_limit = post_job(api, {"pipeline": "tiny", "preview": {"max_side": TINY_PREVIEW_SIDE}})
    assert at_limit.status_code == 201, at_limit.text
    # without previews the preview limits do not apply
    assert post_job(api, {"pipeline": "tiny"}).status_code == 201


def test_previews_more_often_than_the_pipeline_takes_are_refused(api: Api) -> None:
    announce(api, "node-a", {"custom": PipelineLimits(min_preview_every_steps=4)})
    error = only_error(post_job(api, {"pipeline": "custom", "preview": {"every_steps": 2}}))
    assert error["type"] == "pipeline_limit"
    assert error["loc"] == ["body", "preview", "every_steps"]
    assert error["ctx"] == {"limit": "min_preview_every_steps", "pipeline": "custom"}
    assert error["msg"] == "custom takes preview.every_steps ≥ 4; got 2"
    accepted = post_job(api, {"pipeline": "custom", "preview": {"every_steps": 4}})
    assert accepted.status_code == 201, accepted.text


def test_previews_any_live_node_takes_are_accepted(api: Api) -> None:
    announce(api, "node-a", {"custom": PipelineLimits(min_preview_every_steps=4)})
    announce(api, "node-b", {"custom": PipelineLimits(min_preview_every_steps=1)})
    assert post_job(api, {"pipeline": "custom", "preview": {"every_steps": 2}}).status_code == 201


def test_a_batch_line_over_a_preview_limit_is_refused_at_its_line(api: Api) -> None:
    lines = [
        {**SMALL, "custom_id": "fine", "preview": {"max_side": 64}},
        {**SMALL, "custom_id": "large", "preview": {"max_side": TINY_PREVIEW_SIDE * 2}},
    ]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    refused = httpx.post(
        f"{api.url}/v1/batches",
        content=body,
        params={"pipeline": "tiny"},
        headers={**api.auth(), "Content-Type": "application/x-ndjson"},
        timeout=60,
    )
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"][1:]
    assert error["type"] == "pipeline_limit"
    assert error["loc"] == ["body", "line", 2, "preview", "max_side"]
    assert f"preview.max_side ≤ {TINY_PREVIEW_SIDE}" in error["msg"]


def test_the_submitter_refuses_for_python_callers(job_store: JobStore) -> None:
    published: list[str] = []
    submitter = Submitter(job_store, api_settings(), lambda job_id, *_: published.append(job_id))
    request = JobRequest.model_validate(
        {**SMALL, "pipeline": "tiny", "preview": {"max_side": TINY_PREVIEW_SIDE * 2}}
    )
    with pytest.raises(Refused) as refused:
        Intake(submitter, None).submit(request)
    error = refused.value.refusal
    assert (error.code, error.loc) == ("pipeline_limit", ("preview", "max_side"))
    assert error.context["limit"] == "max_preview_side"
    assert published == []


def test_a_node_refuses_the_rank_side_request_over_its_preview_limits() -> None:
    limits = PipelineLimits.from_dict(TINY_LIMITS["tiny"])
    base = GenerationRequest(
        "r", "tiny", "p", width=64, height=64, steps=4, seed=1, guidance_scale=5.0
    )
    assert limits.violation("tiny", base) is None
    wide = replace(base, preview=PreviewSpec(1, TINY_PREVIEW_SIDE + 1))
    violation = limits.violation("tiny", wide)
    assert violation is not None
    assert (violation.field, violation.limit) == ("preview.max_side", "max_preview_side")
    assert violation.describe().startswith("preview.max_side: tiny takes preview.max_side ≤")
    strict = PipelineLimits(min_preview_every_steps=3)
    often = replace(base, preview=PreviewSpec(every_steps=2))
    refused = strict.violation("tiny", often)
    assert refused is not None
    assert refused.limit == "min_preview_every_steps"
