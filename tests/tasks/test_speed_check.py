"""The request's `speed`: checked against the modes live nodes announce, recorded, run as asked.

The check alone on declarations given as data; then through the API (real uvicorn, real Redis
heartbeats): a pipeline announcing `exact` only refuses `fast` with a 422 naming `speed` and the
modes it serves; one announcing all three takes it, and the job's parameters keep the mode.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kiln.common.limits import TINY_LIMITS
from kiln.common.request import SPEED_KEY, SPEED_MODES
from kiln.gpu_worker.protocol import GenerationResult, RunMetrics, SpeedReport
from kiln.tasks.contract.request_check import PipelineDecl, check_request
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.compute import DeliveredJob, run_metrics
from tests.tasks.helpers import Api
from tests.tasks.node.test_compute import record_of
from tests.tasks.test_inputs import TINY_SCHEMA

SMALL: dict[str, Any] = {"pipeline": "tiny", "prompt": "a fox", "width": 64, "height": 64}
EXACT_ONLY = {**TINY_SCHEMA, SPEED_KEY: ["exact"]}
ALL_MODES = {**TINY_SCHEMA, SPEED_KEY: list(SPEED_MODES)}


def declared(*schemas: dict[str, Any]) -> PipelineDecl:
    return PipelineDecl(known=("tiny",), inputs=schemas)


def test_exact_is_the_default_and_unknown_modes_fail_the_schema() -> None:
    assert JobRequest(**SMALL).speed == "exact"
    assert "speed" not in JobRequest(**SMALL).to_record()  # records keep their old fingerprint
    assert JobRequest(**SMALL, speed="fast").to_record()["speed"] == "fast"
    with pytest.raises(ValueError, match="speed"):
        JobRequest(**SMALL, speed="ludicrous")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["balanced", "fast"])
def test_a_mode_no_live_node_announces_is_refused_naming_speed(mode: str) -> None:
    for decl in (declared(EXACT_ONLY), declared(TINY_SCHEMA), declared()):
        violation = check_request(JobRequest(**SMALL, speed=mode), decl)  # type: ignore[arg-type]
        assert violation is not None
        assert (violation.kind, violation.loc(("body",)), violation.value) == (
            "speed_mode",
            ("body", "speed"),
            mode,
        )
        assert violation.context()["supported"] == ["exact"]
        assert "serves exact" in violation.message


def test_a_mode_any_live_node_announces_passes() -> None:
    request = JobRequest(**SMALL, speed="fast")
    assert check_request(request, declared(EXACT_ONLY, ALL_MODES)) is None
    assert check_request(JobRequest(**SMALL), declared(EXACT_ONLY)) is None


def test_the_api_refuses_fast_where_the_pipeline_has_no_hooks(api: Api) -> None:
    info = {
        "pipelines": ["tiny", "tiny-dit"],
        "limits": {name: dict(TINY_LIMITS[name]) for name in ("tiny", "tiny-dit")},
        "inputs": {"tiny": EXACT_ONLY, "tiny-dit": ALL_MODES},
    }
    api.store.publish_node("node-a", info, ttl_s=30)
    refused = httpx.post(f"{api.url}/v1/jobs", json={**SMALL, "speed": "fast"}, headers=api.auth())
    assert refused.status_code == 422, refused.text
    (error,) = refused.json()["detail"]
    assert (error["loc"], error["type"], error["ctx"]["supported"]) == (
        ["body", "speed"],
        "speed_mode",
        ["exact"],
    )
    dit = {**SMALL, "pipeline": "tiny-dit", "speed": "fast"}
    accepted = httpx.post(f"{api.url}/v1/jobs", json=dit, headers=api.auth())
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["parameters"]["speed"] == "fast"
    shown = httpx.get(f"{api.url}/v1/pipelines/tiny-dit", headers=api.auth()).json()
    assert shown["inputs"][SPEED_KEY] == list(SPEED_MODES)


def test_the_node_passes_the_mode_on_and_records_what_ran() -> None:
    record = record_of(JobRequest(**SMALL, seed=3, speed="balanced"))
    assert DeliveredJob.decode(record).compute.speed == "balanced"
    report = SpeedReport("balanced", "first_block_cache", 0.05, False, 48, 15)
    result = GenerationResult("j1", [], RunMetrics(0.5, 10.0, 8, 1, speed=report))
    metrics = run_metrics(record, result, 0.01, 0.02)
    assert metrics["speed"] == {
        "mode": "balanced",
        "cache": "first_block_cache",
        "threshold": 0.05,
        "tf32": False,
        "block_calls": 48,
        "block_calls_skipped": 15,
    }
