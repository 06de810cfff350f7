"""A request's static checks in one pass (`contract.request_check`), used by the API and batches.

The function alone on declarations given as data; then through the API (real uvicorn, real
Redis heartbeats): the pure pass refuses before any lookup (no DNS for the webhook), and a batch
line gets the same checks as POST /v1/jobs (its adapters included).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kiln.tasks.contract.image_refs import ImageRef
from kiln.tasks.contract.limits import BUILTIN_LIMITS, LimitViolation
from kiln.tasks.contract.loras import AdapterViolation, LoraSpec, NodeAdapters
from kiln.tasks.contract.request_check import (
    PipelineDecl,
    PipelineUnknown,
    check_request,
    image_refs,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.webhooks.ssrf import Resolver
from tests.tasks.helpers import Api, ApiFactory
from tests.tasks.test_batches import jsonl, post_batch
from tests.tasks.test_inputs import TINY_SCHEMA

SMALL: dict[str, Any] = {"pipeline": "tiny", "prompt": "a fox", "width": 64, "height": 64}
UPLOAD = "upload:" + "ab" * 16
DECLARED = PipelineDecl(
    known=("tiny",),
    limits=(BUILTIN_LIMITS["tiny"],),
    inputs=(TINY_SCHEMA,),
    adapters=(NodeAdapters(node_id="node-a", available=("ember",)),),
)


def test_a_request_every_declaration_takes_passes() -> None:
    request = JobRequest(**SMALL, inputs={"eta": 0.5}, loras=[LoraSpec(name="ember")])
    assert check_request(request, DECLARED) is None


@pytest.mark.parametrize(
    ("changes", "kind", "loc"),
    [
        ({"pipeline": "huge"}, "unknown_pipeline", ("pipeline",)),
        ({"width": 2048}, "pipeline_limit", ("width",)),
        ({"inputs": {"eta": 5}}, "pipeline_input", ("inputs", "eta")),
        ({"inputs": {"image": "ftp://x/a.png"}}, "pipeline_input", ("inputs", "image")),
        ({"loras": [{"name": "smoke"}]}, "unknown_adapter", ("loras", 0, "name")),
    ],
)
def test_each_declaration_is_checked_in_the_one_pass(
    changes: dict[str, Any], kind: str, loc: tuple[str | int, ...]
) -> None:
    violation = check_request(JobRequest(**{**SMALL, **changes}), DECLARED)
    assert violation is not None
    assert (violation.kind, violation.loc()) == (kind, loc)
    assert violation.message


def test_the_first_refusal_follows_the_order_name_limits_inputs_adapters() -> None:
    over_all = JobRequest(
        **{**SMALL, "width": 2048}, inputs={"eta": 5}, loras=[LoraSpec(name="smoke")]
    )
    assert isinstance(check_request(over_all, DECLARED), LimitViolation)
    past_limits = over_all.model_copy(update={"width": 64})
    assert check_request(past_limits, DECLARED).kind == "pipeline_input"  # type: ignore[union-attr]
    past_inputs = past_limits.model_copy(update={"inputs": {}})
    assert isinstance(check_request(past_inputs, DECLARED), AdapterViolation)
    unknown = check_request(JobRequest(**{**SMALL, "pipeline": "huge"}), DECLARED)
    assert isinstance(unknown, PipelineUnknown)
    assert unknown.context() == {"known": ["tiny"]}


def test_image_refs_are_the_inputs_the_schemas_mark_as_images() -> None:
    request = JobRequest(**SMALL, inputs={"image": UPLOAD, "eta": 0.5})
    assert image_refs(request, DECLARED) == {"image": ImageRef("upload", "ab" * 16)}
    assert image_refs(request, PipelineDecl(known=("tiny",))) == {}


def counting_dns(lookups: list[str]) -> Resolver:
    """A DNS that answers every host with a private address and notes each lookup."""

    def resolve(host: str, _port: int) -> list[str]:
        lookups.append(host)
        return ["10.0.0.1"]

    return resolve


def announce_adapters(api: Api) -> None:
    """A heartbeat of a node serving `tiny` that offers the adapter `ember`."""
    adapters = {"tiny": {"available": ["ember"], "loaded": [], "fused": []}}
    info = {"node_id": "node-a", "pipelines": ["tiny"], "adapters": adapters}
    api.store.publish_node("node-a", info, ttl_s=30)


def test_the_api_refuses_a_static_violation_before_any_lookup(make_api: ApiFactory) -> None:
    lookups: list[str] = []
    api = make_api(resolve=counting_dns(lookups), webhook_allow_hosts=[])
    announce_adapters(api)
    body = {**SMALL, "loras": [{"name": "smoke"}], "webhook": {"url": "https://hooks.test/x"}}
    refused = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]
    assert (error["loc"], error["type"]) == (["body", "loras", 0, "name"], "unknown_adapter")
    assert error["ctx"] == {"pipeline": "tiny", "known": ["ember"]}
    assert lookups == []  # the webhook's host was never resolved
    body["loras"] = [{"name": "ember"}]
    unsafe = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert unsafe.status_code == 422, unsafe.text
    assert unsafe.json()["detail"][0]["type"] == "unsafe_url"
    assert lookups == ["hooks.test"]


def test_a_batch_line_gets_the_adapter_check_too(api: Api) -> None:
    announce_adapters(api)
    lines = [{**SMALL, "custom_id": "a", "loras": [{"name": "smoke"}]}]
    refused = post_batch(api, jsonl(lines))
    assert refused.status_code == 422, refused.text
    errors = [e for e in refused.json()["detail"] if e.get("line") == 1]
    assert [(e["loc"][-3:], e["type"]) for e in errors] == [
        (["loras", 0, "name"], "unknown_adapter")
    ]
