"""A request whose steps and `inputs.strength` leave no denoising step is refused at submit.

img2img, inpaint and video-to-video pipelines run int(steps × strength) denoising steps (as
diffusers counts them); none fails the forward on the ranks. The contract's rule alone, then the
API's 422 for POST /v1/jobs and for a batch line, each naming `steps` and `inputs.strength`.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from kiln.tasks.contract.inputs import input_violation
from tests.tasks.helpers import Api, ApiFactory, fake_dns
from tests.tasks.test_batches import jsonl, post_batch
from tests.tasks.test_inputs import SMALL, TINY_SCHEMA, announce

IMG2IMG: dict[str, Any] = copy.deepcopy(TINY_SCHEMA)
IMG2IMG["properties"]["strength"] = {"type": "number", "minimum": 0, "maximum": 1, "default": 0.8}


@pytest.mark.parametrize(
    ("steps", "inputs"),
    [(1, {"strength": 0.5}), (4, {"strength": 0.2}), (1, {}), (10, {"strength": 0.0})],
)
def test_no_denoising_step_is_refused_naming_steps_and_strength(
    steps: int, inputs: dict[str, Any]
) -> None:
    violation = input_violation(
        "img", IMG2IMG, {"image": "https://example.com/a.png", **inputs}, steps
    )
    assert violation is not None
    assert (violation.name, violation.rule) == ("strength", "denoising_steps")
    assert violation.context()["fields"] == ["steps", "inputs.strength"]
    assert f"steps {steps}" in violation.message
    assert "strength" in violation.message


@pytest.mark.parametrize(
    ("steps", "inputs"), [(2, {"strength": 0.5}), (5, {"strength": 0.2}), (2, {}), (1, {"eta": 0})]
)
def test_at_least_one_denoising_step_is_taken(steps: int, inputs: dict[str, Any]) -> None:
    schema = IMG2IMG if inputs != {"eta": 0} else TINY_SCHEMA  # no strength: no rule
    assert (
        input_violation("img", schema, {"image": "https://example.com/a.png", **inputs}, steps)
        is None
    )


@pytest.fixture
def img_api(make_api: ApiFactory) -> Api:
    """An API whose DNS knows example.com (a public address), with an img2img node announced."""
    api = make_api(resolve=fake_dns({"example.com": ["93.184.216.34"]}))
    announce(api, schema=IMG2IMG)
    return api


def test_the_api_refuses_it_with_a_422_naming_both_fields(img_api: Api) -> None:
    api = img_api
    announce(api, schema=IMG2IMG)
    body = {**SMALL, "steps": 1, "inputs": {"image": "https://example.com/a.png", "strength": 0.5}}
    refused = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]
    assert error["loc"] == ["body", "inputs", "strength"]
    assert error["ctx"]["fields"] == ["steps", "inputs.strength"]
    assert "steps 1" in error["msg"]
    assert "strength 0.5" in error["msg"]
    body["steps"] = 2
    accepted = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert accepted.status_code == 201, accepted.text


def test_a_batch_line_is_refused_alike(img_api: Api) -> None:
    api = img_api
    announce(api, schema=IMG2IMG)
    line = {**SMALL, "custom_id": "a", "steps": 1}
    line["inputs"] = {"image": "https://example.com/a.png", "strength": 0.5}
    refused = post_batch(api, jsonl([line]))
    assert refused.status_code == 422, refused.text
    errors = [e for e in refused.json()["detail"] if e.get("line") == 1]
    assert errors
    assert errors[0]["loc"][-2:] == ["inputs", "strength"]
    assert "steps 1" in errors[0]["msg"]
