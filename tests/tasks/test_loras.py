"""A job's `loras`: the field's own rules, the API's check against announced adapters, the CLI.

Adapters are announced in node heartbeats (real Redis) as `Node.health()` writes them; the API
(real uvicorn) refuses an adapter no live node serving the pipeline offers, naming
`loras[i].name`, and lists each adapter with the nodes that offer, load and fuse it.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kiln.storage.job_store import request_fingerprint
from kiln.tasks.cli.commands import parse_loras
from kiln.tasks.cli.exits import UsageError
from kiln.tasks.cli.main import EXIT_JOB_FAILED, EXIT_USAGE
from kiln.tasks.contract.loras import MAX_LORA_SCALE, MAX_LORAS, LoraSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.adapters import AdapterSources
from tests.tasks.helpers import Api

SMALL: dict[str, Any] = {"pipeline": "tiny", "prompt": "a fox", "width": 64, "height": 64}


def announce(api: Api, node_id: str, available: list[str], **held: list[str]) -> None:
    """A heartbeat of a node serving `tiny` with these adapters (and `loaded`, `fused`)."""
    adapters = {"tiny": {"available": available, "loaded": [], "fused": [], **held}}
    info = {"node_id": node_id, "pipelines": ["tiny"], "adapters": adapters}
    api.store.publish_node(node_id, info, ttl_s=30)


def post_job(api: Api, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={**SMALL, **body}, headers=api.auth())


def only_error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    (error,) = response.json()["detail"]
    return dict(error)


@pytest.mark.parametrize(
    ("loras", "loc"),
    [
        ([{"name": "a.b"}], ("loras", 0, "name")),  # a dot would split PEFT module paths
        ([{"name": "../up"}], ("loras", 0, "name")),
        ([{"name": ""}], ("loras", 0, "name")),
        ([{"name": "a", "scale": MAX_LORA_SCALE + 1}], ("loras", 0, "scale")),
        ([{"name": "a", "scale": float("nan")}], ("loras", 0, "scale")),
        ([{"name": "a", "weight": 1}], ("loras", 0, "weight")),
        ([{"name": "a"}, {"name": "a"}], ("loras",)),
        ([{"name": f"a{i}"} for i in range(MAX_LORAS + 1)], ("loras",)),
    ],
)
def test_the_field_refuses_what_no_node_could_load(
    loras: list[dict[str, Any]], loc: tuple[str | int, ...]
) -> None:
    with pytest.raises(ValidationError) as refused:
        JobRequest.model_validate({**SMALL, "loras": loras})
    assert [error["loc"] for error in refused.value.errors()] == [loc]


def test_requests_without_adapters_keep_their_fingerprint() -> None:
    plain = JobRequest(**SMALL)
    assert "loras" not in plain.to_record()
    record = JobRequest(**SMALL, loras=[LoraSpec(name="ember", scale=0.5)]).to_record()
    assert record["loras"] == [{"name": "ember", "scale": 0.5}]
    assert request_fingerprint(record) != request_fingerprint(plain.to_record())


def test_an_adapter_no_live_node_offers_is_a_422_naming_it(api: Api) -> None:
    announce(api, "node-a", ["ember"])
    announce(api, "node-b", ["frost"])
    # No live node serves tiny-video: nothing to check against; the job waits in its queue.
    waiting = post_job(api, {"pipeline": "tiny-video", "loras": [{"name": "smoke"}]})
    assert waiting.status_code == 201, waiting.text
    error = only_error(post_job(api, {"loras": [{"name": "frost"}, {"name": "smoke"}]}))
    assert (error["loc"], error["type"]) == (["body", "loras", 1, "name"], "unknown_adapter")
    assert error["ctx"]["known"] == ["ember", "frost"]
    accepted = post_job(api, {"loras": [{"name": "ember", "scale": 0.5}, {"name": "frost"}]})
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["parameters"]["loras"][0] == {"name": "ember", "scale": 0.5}


def test_get_pipeline_lists_adapters_and_where_they_are_loaded(api: Api) -> None:
    announce(api, "node-a", ["ember", "frost"], loaded=["ember", "frost"], fused=["ember"])
    announce(api, "node-b", ["ember"])
    response = httpx.get(f"{api.url}/v1/pipelines/tiny", headers=api.auth())
    assert response.status_code == 200, response.text
    assert response.json()["adapters"] == [
        {"name": "ember", "available_on": ["node-a", "node-b"], "loaded_on": ["node-a"],
         "fused_on": ["node-a"]},
        {"name": "frost", "available_on": ["node-a"], "loaded_on": ["node-a"], "fused_on": []},
    ]  # fmt: skip


def test_the_heartbeat_merges_replica_groups_and_lists_every_pipeline() -> None:
    stats = {
        "groups": [
            {"adapters": {"tiny": {"loaded": ["ember"], "fused": ["ember"]}}},
            {"adapters": {"tiny": {"loaded": ["frost"], "fused": []}}},
        ]
    }
    announced = AdapterSources(None).heartbeat(["tiny", "tiny-video"], stats)
    assert announced == {
        "tiny": {"available": [], "loaded": ["ember", "frost"], "fused": ["ember"]},
        "tiny-video": {"available": [], "loaded": [], "fused": []},
    }


# --- the CLI: kiln submit --lora NAME[:SCALE] --------------------------------------------------


def test_cli_loras_are_names_with_an_optional_scale() -> None:
    assert parse_loras(["ember", "frost:0.5", "smoke:-1"]) == [
        {"name": "ember"}, {"name": "frost", "scale": 0.5}, {"name": "smoke", "scale": -1.0},
    ]  # fmt: skip
    with pytest.raises(UsageError, match="SCALE"):
        parse_loras(["ember:strong"])


def kiln(*args: str) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS` in its own process, as a user runs it."""
    command = [sys.executable, "-m", "kiln.tasks.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_cli_submits_loras_through_the_api(api: Api) -> None:
    announce(api, "node-a", ["ember", "frost"])
    base = ["submit", "a fox", "--pipeline", "tiny", "--width", "64", "--height", "64",
            "--api", api.url, "--api-key", api.keys["alice"]]  # fmt: skip
    submitted = kiln(*base, "--lora", "ember:0.5", "--lora", "frost")
    assert submitted.returncode == 0, submitted.stderr
    assert api.store.get(submitted.stdout.strip()).request["loras"] == [
        {"name": "ember", "scale": 0.5}, {"name": "frost", "scale": 1.0},
    ]  # fmt: skip
    # The API's refusal of an adapter no node offers: one line naming it, no traceback.
    refused = kiln(*base, "--lora", "smoke")
    assert refused.returncode == EXIT_JOB_FAILED  # as every refusal the API answers
    assert refused.stderr.strip() == (
        "kiln: HTTP 422: body.loras.0.name: no adapter 'smoke' for pipeline tiny; "
        "available: ember, frost"
    )
    twice = kiln(*base, "--lora", "ember", "--lora", "ember:2")  # refused before any request
    assert twice.returncode == EXIT_USAGE
    assert "an adapter must not be named twice" in twice.stderr
