"""A pipeline that cannot emit previews says so, and a request for previews of it is a 422.

Real uvicorn and the real store in Redis; the heartbeats carry the schemas a node announces for
real fixture pipelines (`announced_schema`): `sleepy` has no VAE and no preview hook, `painted`
names its decoder (tests/e2e/painted_pipelines.py). `GET /v1/pipelines/{name}` shows each one's
request fields and whether it previews (no preview limits when not); `POST /v1/jobs` and the
Submitter refuse previews of `sleepy` through the one request check.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from kiln.gpu_worker.pipelines import Pipeline
from kiln.gpu_worker.pipelines.announced import announced_schema
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.intake.refusal import Refused
from kiln.tasks.queue.submit import Submitter
from tests.e2e.painted_pipelines import PaintedPipeline
from tests.e2e.pipelines import SleepyPipeline
from tests.tasks.helpers import Api

CPU = torch.device("cpu")
SMALL = {"prompt": "waves", "width": 64, "height": 64, "steps": 4}
PREVIEW = {"every_steps": 1, "max_side": 64}


@pytest.fixture
def served(api: Api) -> Api:
    """The API with one live node announcing `sleepy` and `painted` as a node does."""
    pipelines: dict[str, Pipeline] = {
        "sleepy": SleepyPipeline(CPU),
        "painted": PaintedPipeline(CPU),
    }
    info = {
        "pipelines": sorted(pipelines),
        "limits": {},
        "inputs": {name: announced_schema(p) for name, p in pipelines.items()},
    }
    api.store.publish_node("node-a", info, ttl_s=30)
    return api


def pipeline_info(api: Api, name: str) -> dict[str, Any]:
    answer = httpx.get(f"{api.url}/v1/pipelines/{name}", headers=api.auth())
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_the_pipeline_route_shows_fields_and_previews_and_no_preview_limits_without(
    served: Api,
) -> None:
    sleepy, painted = pipeline_info(served, "sleepy"), pipeline_info(served, "painted")
    assert sleepy["fields"] == sorted(SleepyPipeline(CPU).supported_fields())
    assert sleepy["previews"] is False
    assert not {"max_preview_side", "min_preview_every_steps"} & set(sleepy["limits"])
    assert painted["previews"] is True
    assert {"max_preview_side", "min_preview_every_steps"} <= set(painted["limits"])
    # a built-in no node announces yet: nothing known, previews allowed, fields unknown
    tiny = pipeline_info(served, "tiny")
    assert (tiny["previews"], tiny["fields"]) == (True, None)


def test_a_request_for_previews_of_a_pipeline_that_cannot_emit_them_is_a_422(
    served: Api,
) -> None:
    body = {**SMALL, "pipeline": "sleepy", "preview": PREVIEW}
    refused = httpx.post(f"{served.url}/v1/jobs", json=body, headers=served.auth())
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]
    assert error["loc"] == ["body", "preview"]
    assert error["type"] == "previews_unsupported"
    assert error["msg"].startswith("sleepy emits no previews: its pipeline names no preview")
    assert "submit without `preview`" in error["msg"]
    # the same job without previews, and previews of a pipeline that names a decoder: accepted
    plain = {**SMALL, "pipeline": "sleepy"}
    assert httpx.post(f"{served.url}/v1/jobs", json=plain, headers=served.auth()).status_code == 201
    painted = {**SMALL, "pipeline": "painted", "preview": PREVIEW}
    answer = httpx.post(f"{served.url}/v1/jobs", json=painted, headers=served.auth())
    assert answer.status_code == 201, answer.text


def test_the_submitter_refuses_it_too(served: Api) -> None:
    submitter = Submitter(served.store, served.settings, publish=lambda *_a, **_k: None)
    request = JobRequest.model_validate({**SMALL, "pipeline": "sleepy", "preview": PREVIEW})
    with pytest.raises(Refused, match="sleepy emits no previews"):
        Intake(submitter, None).submit(request)
