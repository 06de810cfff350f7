"""A request's `inputs`, checked against the schema its pipeline's nodes announce.

The validator (a JSON Schema subset, torch-free), request fields given as inputs, the API's 422s
naming `body.inputs.<name>`, `GET /v1/pipelines/{name}`, the Submitter, the client and the CLI
(the node's own check is tests/tasks/node/test_node_inputs.py). Real uvicorn and the real store
in Redis; the schema is announced in a node heartbeat as `Node.health()` writes it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kiln.common.limits import TINY_LIMITS
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.commands import parse_inputs
from kiln.tasks.cli.exits import UsageError
from kiln.tasks.cli.main import EXIT_USAGE, main
from kiln.tasks.client.client import KilnClient, ValidationFailed
from kiln.tasks.contract.input_values import value_violation
from kiln.tasks.contract.inputs import input_violation
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.intake.refusal import Refused
from kiln.tasks.queue.submit import Submitter
from tests.tasks.helpers import Api, api_settings, write_many

SMALL: dict[str, Any] = {
    "pipeline": "tiny",
    "prompt": "a fox",
    "width": 64,
    "height": 64,
    "steps": 2,
}
SCHEDULERS = ["EulerDiscreteScheduler", "DDIMScheduler", "PNDMScheduler"]
# What the tiny pipeline's ranks derive (tests/gpu_worker/test_inputs.py checks the real one).
TINY_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "tiny inputs",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string", "minLength": 1, "maxLength": 4000, "x-kiln-field": "prompt"},
        "width": {"type": "integer", "minimum": 64, "maximum": 1024, "multipleOf": 8,
                  "x-kiln-field": "width"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 200,
                                "x-kiln-field": "steps"},
        "eta": {"type": "number", "minimum": 0.0, "maximum": 1.0, "default": 0.0},
        "clip_skip": {"type": "integer", "minimum": 0, "maximum": 1},
        "scheduler": {"type": "string", "enum": SCHEDULERS, "default": SCHEDULERS[0]},
        "image": {"type": "string", "minLength": 1, "x-kiln-image": True},
    },
}  # fmt: skip


def announce(api: Api, node_id: str = "node-a", schema: dict[str, Any] | None = None) -> None:
    """A heartbeat of a node serving `tiny` with this input schema (TINY_SCHEMA by default)."""
    info = {
        "pipelines": ["tiny"],
        "limits": {"tiny": dict(TINY_LIMITS["tiny"])},
        "inputs": {"tiny": schema if schema is not None else TINY_SCHEMA},
    }
    api.store.publish_node(node_id, info, ttl_s=30)


def post_job(api: Api, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={**SMALL, **body}, headers=api.auth())


def only_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    return dict(error)


# --- the validator ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "prop", "rule"),
    [
        (1.5, {"type": "integer"}, "type"),
        (True, {"type": "integer"}, "type"),  # JSON booleans are not numbers
        (True, {"type": "number"}, "type"),
        ("1", {"type": "number"}, "type"),
        (None, {"type": "string"}, "type"),
        (1, {"enum": [True, "a"]}, "enum"),  # 1 is not true
        ("b", {"enum": ["a"]}, "enum"),
        (2, {"const": 3}, "const"),
        (-0.1, {"minimum": 0}, "minimum"),
        (1.01, {"maximum": 1}, "maximum"),
        (0, {"exclusiveMinimum": 0}, "exclusiveMinimum"),
        (1, {"exclusiveMaximum": 1}, "exclusiveMaximum"),
        (12, {"multipleOf": 8}, "multipleOf"),
        ("", {"minLength": 1}, "minLength"),
        ("abcd", {"maxLength": 3}, "maxLength"),
        ("x-1", {"pattern": "^[a-z]+$"}, "pattern"),
    ],
)
def test_a_value_breaking_a_keyword_is_refused_by_that_keyword(
    value: Any, prop: dict[str, Any], rule: str
) -> None:
    broken = value_violation(value, prop)
    assert broken is not None
    assert broken[0] == rule


@pytest.mark.parametrize(
    ("value", "prop"),
    [
        (2, {"type": "number", "minimum": 0, "maximum": 2}),  # an integer is a number
        (2.0, {"type": "integer", "multipleOf": 2}),  # 2.0 is an integer in JSON Schema
        (0.3, {"multipleOf": 0.1}),
        (1.0, {"enum": [1]}),
        (None, {"type": ["string", "null"]}),
        ("DDIMScheduler", {"type": "string", "enum": SCHEDULERS}),
        (5, {"type": "integer", "description": "other keywords are annotations"}),
    ],
)
def test_a_value_within_its_keywords_is_taken(value: Any, prop: dict[str, Any]) -> None:
    assert value_violation(value, prop) is None


def test_unknown_request_field_and_image_inputs_are_refused_by_the_schema() -> None:
    unknown = input_violation("tiny", TINY_SCHEMA, {"strength": 0.5})
    assert unknown is not None
    assert (unknown.kind, unknown.rule, unknown.known) == (
        "unknown_input", "unknown", ("clip_skip", "eta", "image", "scheduler"),
    )  # fmt: skip
    field = input_violation("tiny", TINY_SCHEMA, {"num_inference_steps": 3})
    assert field is not None
    assert field.rule == "unknown"  # a request field is never an extra input
    assert input_violation("tiny", TINY_SCHEMA, {"image": "https://example.com/cat.png"}) is None
    image = input_violation("tiny", TINY_SCHEMA, {"image": "cat.png"})
    assert image is not None
    assert (image.rule, image.message) == (
        "image", "tiny's image: 'cat.png' is neither upload:<upload_id> (POST /v1/uploads) nor "
        "an https:// URL",
    )  # fmt: skip
    required = input_violation("tiny", {**TINY_SCHEMA, "required": ["eta"]}, {})
    assert required is not None
    assert (required.rule, required.loc(("body",))) == ("required", ("body", "inputs"))


# --- request fields given as inputs ----------------------------------------------------------


def test_request_fields_under_a_pipelines_names_move_to_the_top_level() -> None:
    request = JobRequest(
        prompt="x",
        inputs={"num_inference_steps": 9, "num_images_per_prompt": 2, "eta": 0.5, "seed": 4},
    )
    assert (request.steps, request.num_outputs, request.seed) == (9, 2, 4)
    assert request.inputs == {"eta": 0.5}
    assert "inputs" not in JobRequest(prompt="x").to_record()  # fingerprints as before


@pytest.mark.parametrize(
    ("body", "loc", "kind"),
    [
        ({"steps": 3, "inputs": {"num_inference_steps": 4}}, ("inputs", "num_inference_steps"),
         "input_conflict"),
        ({"inputs": {"num_outputs": 2, "num_images_per_prompt": 2}},
         ("inputs", "num_images_per_prompt"), "input_conflict"),
        ({"inputs": {"fps": 12}}, ("inputs", "fps"), "request_field"),
        ({"inputs": {"bad-name": 1}}, ("inputs", "bad-name", "[key]"), "string_pattern_mismatch"),
        ({"inputs": {"eta": [1]}}, ("inputs", "eta", "bool"), "bool_type"),
    ],
)  # fmt: skip
def test_a_request_giving_a_field_twice_or_a_bad_input_is_invalid(
    body: dict[str, Any], loc: tuple[str, ...], kind: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        JobRequest.model_validate({"prompt": "x", **body})
    first = refused.value.errors()[0]
    assert (first["loc"], first["type"]) == (loc, kind)


# --- the API -----------------------------------------------------------------------------------


def test_the_api_takes_inputs_the_pipeline_declares(api: Api) -> None:
    announce(api)
    body = {k: v for k, v in SMALL.items() if k != "steps"}
    body["inputs"] = {"scheduler": "DDIMScheduler", "eta": 1, "num_inference_steps": 3}
    response = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert response.status_code == 201, response.text
    parameters = response.json()["parameters"]
    assert parameters["inputs"] == {"scheduler": "DDIMScheduler", "eta": 1}
    assert parameters["steps"] == 3
    stored = api.store.get(response.json()["id"]).request
    assert stored["inputs"] == {"scheduler": "DDIMScheduler", "eta": 1}


@pytest.mark.parametrize(
    ("inputs", "kind", "rule", "message"),
    [
        ({"strength": 0.6}, "unknown_input", "unknown",
         "tiny takes no input 'strength'; its inputs: clip_skip, eta, image, scheduler"),
        ({"eta": 1.5}, "pipeline_input", "maximum", "tiny takes eta ≤ 1; got 1.5"),
        ({"clip_skip": 2}, "pipeline_input", "maximum", "tiny takes clip_skip ≤ 1; got 2"),
        ({"clip_skip": 0.5}, "pipeline_input", "type", "tiny takes clip_skip as integer; got 0.5"),
        ({"scheduler": "LMSDiscreteScheduler"}, "pipeline_input", "enum",
         "tiny takes scheduler as one of EulerDiscreteScheduler, DDIMScheduler, PNDMScheduler; "
         "got 'LMSDiscreteScheduler'"),
        ({"image": "upload:cat"}, "pipeline_input", "image",
         "tiny's image: 'upload:cat' is not upload:<upload_id> (32 hex digits)"),
    ],
)  # fmt: skip
def test_the_api_refuses_an_input_naming_it(
    api: Api, inputs: dict[str, Any], kind: str, rule: str, message: str
) -> None:
    announce(api)
    error = only_error(post_job(api, {"inputs": inputs}))
    (name,) = inputs
    assert error["loc"] == ["body", "inputs", name]
    assert (error["type"], error["ctx"]["rule"], error["ctx"]["pipeline"]) == (kind, rule, "tiny")
    assert error["msg"] == message
    assert error["input"] == inputs[name]
    if kind == "unknown_input":
        assert error["ctx"]["known"] == ["clip_skip", "eta", "image", "scheduler"]


def test_the_api_refuses_a_field_given_twice(api: Api) -> None:
    announce(api)
    error = only_error(post_job(api, {"steps": 4, "inputs": {"num_inference_steps": 4}}))
    assert (error["loc"], error["type"]) == (
        ["body", "inputs", "num_inference_steps"], "input_conflict",
    )  # fmt: skip
    assert error["ctx"]["field"] == "steps"


def test_inputs_need_a_live_node_announcing_a_schema(api: Api) -> None:
    error = only_error(post_job(api, {"inputs": {"eta": 0.5}}))
    assert (error["loc"], error["type"], error["ctx"]["rule"]) == (
        ["body", "inputs", "eta"], "unknown_input", "undeclared",
    )  # fmt: skip
    assert post_job(api, {}).status_code == 201  # without inputs: as before


def test_a_request_any_live_nodes_schema_takes_is_accepted(api: Api) -> None:
    strict = copy.deepcopy(TINY_SCHEMA)
    strict["properties"]["eta"]["maximum"] = 0.5
    announce(api, "strict", strict)
    announce(api, "loose")
    assert post_job(api, {"inputs": {"eta": 0.9}}).status_code == 201


def test_get_pipeline_returns_its_schema_limits_and_adapters(api: Api) -> None:
    announce(api)
    response = httpx.get(f"{api.url}/v1/pipelines/tiny", headers=api.auth())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body.pop("backlog")["nodes"]["live"] == 1  # (tests/tasks/test_backlog.py)
    assert body == {
        "name": "tiny",
        "live_nodes": 1,
        "inputs": TINY_SCHEMA,
        "fields": None,  # announced without the marks (tests/tasks/test_preview_support.py)
        "previews": True,
        "limits": dict(TINY_LIMITS["tiny"]),
        "adapters": [],
    }
    with KilnClient(api.url, api.keys["alice"]) as client:
        info = client.pipeline("tiny")
        assert info.inputs == TINY_SCHEMA
        view = client.submit(JobRequest(**SMALL, inputs={"scheduler": "PNDMScheduler"}))
        assert view.parameters.inputs == {"scheduler": "PNDMScheduler"}
        with pytest.raises(ValidationFailed) as refused:
            client.submit(JobRequest(**SMALL, inputs={"eta": 2}))
        assert list(refused.value.fields) == ["body.inputs.eta"]


def test_get_pipeline_before_any_node_and_for_an_unknown_name(api: Api) -> None:
    quiet = httpx.get(f"{api.url}/v1/pipelines/tiny-video", headers=api.auth())
    assert quiet.status_code == 200, quiet.text
    body = quiet.json()
    assert (body["live_nodes"], body["inputs"], body["adapters"]) == (0, None, [])
    assert body["limits"]["max_frames"] == 81  # the built-in name's static limits
    missing = httpx.get(f"{api.url}/v1/pipelines/nope", headers=api.auth())
    assert missing.status_code == 404
    assert "no pipeline 'nope'" in missing.json()["detail"]
    assert httpx.get(f"{api.url}/v1/pipelines/tiny").status_code == 401


def test_the_submitter_refuses_for_python_callers(job_store: JobStore) -> None:
    announce_info = {"pipelines": ["tiny"], "inputs": {"tiny": TINY_SCHEMA}}
    job_store.publish_node("node-a", announce_info, ttl_s=30)
    submitter = Submitter(job_store, api_settings(), lambda *_args, **_kw: None)
    intake = Intake(submitter, None)
    with pytest.raises(Refused) as refused:
        intake.submit(JobRequest(**SMALL, inputs={"eta": -1}))
    error = refused.value.refusal
    assert (error.status, error.code, error.loc) == (422, "pipeline_input", ("inputs", "eta"))
    with pytest.raises(Refused) as in_bulk:
        write_many(intake, [JobRequest(**SMALL), JobRequest(**SMALL, inputs={"x": 1})])
    assert in_bulk.value.refusal.loc == ("inputs", "x")


# --- the CLI ------------------------------------------------------------------------------------


def test_cli_inputs_are_json_when_they_parse_else_text() -> None:
    parsed = parse_inputs(["strength=0.6", "scheduler=EulerDiscreteScheduler", "n=3", "on=true",
                           "label=\"7\"", "empty="])  # fmt: skip
    assert parsed == {
        "strength": 0.6, "scheduler": "EulerDiscreteScheduler", "n": 3, "on": True, "label": "7",
        "empty": "",
    }  # fmt: skip
    for bad in (["noequals"], ["=3"], ["a=1", "a=2"]):
        with pytest.raises(UsageError):
            parse_inputs(bad)


def test_cli_submits_inputs_and_refuses_missing_files(
    tmp_path: Path,
    job_store: JobStore,
    storage_settings: StorageSettings,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("KILN_REDIS_URL", storage_settings.redis_url)
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", storage_settings.redis_namespace)
    monkeypatch.setenv("KILN_STORAGE_URL", storage_settings.storage_url)
    job_store.publish_node("node-a", {"pipelines": ["tiny"], "inputs": {"tiny": TINY_SCHEMA}}, 30)
    base = ["submit", "a fox", "--pipeline", "tiny", "--width", "64", "--height", "64"]
    assert main([*base, "--input", "scheduler=DDIMScheduler", "--input", "eta=0.25"]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_store.get(job_id).request["inputs"] == {"scheduler": "DDIMScheduler", "eta": 0.25}
    assert main([*base, "--input", f"image=@{tmp_path / 'missing.png'}"]) == EXIT_USAGE
    assert "cannot read" in capsys.readouterr().err
    assert main([*base, "--input", "eta=3"]) == EXIT_USAGE
    assert (
        capsys.readouterr().err.strip()
        == "kiln: invalid job: inputs.eta: tiny takes eta ≤ 1; got 3"
    )
