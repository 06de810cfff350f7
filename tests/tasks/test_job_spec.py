"""The job spec (contract/job_spec.py): its encoding, its one decode, its version rule."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kiln.common.states import JobState
from kiln.storage.job_store import JobRecord, NewJob
from kiln.tasks.batches.intake import item_line, parse_item
from kiln.tasks.contract.job_spec import JOB_SPEC_ERROR, JOB_SPEC_VERSION, JobSpec, JobSpecRefused
from kiln.tasks.contract.loras import LoraSpec
from kiln.tasks.contract.schemas import CheckpointRequest, JobRequest, PreviewRequest, WebhookSpec
from kiln.tasks.contract.views import job_view
from tests.tasks.helpers import Api

# A record's `request` as the release before the spec's version wrote it (Intake.accept stored
# the effective request's full dump, no `version`), read back from Redis as JSON.
PREVIOUS_RELEASE = (
    '{"pipeline":"tiny","prompt":"a kiln","negative_prompt":null,"width":64,"height":64,'
    '"num_frames":1,"fps":8,"steps":3,"guidance_scale":7.0,"seed":1234,"num_outputs":2,'
    '"output_format":"webp","priority":"bulk","webhook":{"url":"https://hooks.example.com/k",'
    '"events":["completed"]},"start_by":null,"max_run_seconds":30.0,"metadata":{"team":"a"},'
    '"inputs":{"scheduler":"DDIMScheduler"},"preview":{"every_steps":2,"max_side":256,'
    '"format":"webp"},"loras":[{"name":"ember","scale":0.5}],"speed":"balanced"}'
)
# ... and as the releases before that stored it (`to_record`: no inputs, loras, preview or
# speed when they were empty or the default)
OLDER_RELEASE = (
    '{"pipeline":"default","prompt":"a fox","negative_prompt":null,"width":512,"height":512,'
    '"num_frames":5,"fps":12,"steps":25,"guidance_scale":7.5,"seed":7,"num_outputs":1,'
    '"output_format":"gif","priority":"interactive","webhook":null,"start_by":1700000000.5,'
    '"max_run_seconds":null,"metadata":{}}'
)


def spec(**fields: Any) -> JobSpec:
    """The spec of an accepted request (its seed given)."""
    return JobSpec.of(JobRequest(**{"prompt": "a kiln", "seed": 3, **fields}))


def record_of(stored: dict[str, Any]) -> JobRecord:
    """A queued record holding `stored` as its request."""
    return JobRecord(
        id="a" * 32, state=JobState.QUEUED, request=stored, lane="interactive", owner=None,
        created_at=time.time(), started_at=None, finished_at=None, attempts=0, progress=None,
        outputs=[], error=None, metrics={}, batch_id=None, metadata={}, published=True,
    )  # fmt: skip


def test_a_spec_round_trips_through_its_record_and_its_item_line() -> None:
    full = spec(
        pipeline="tiny",
        inputs={"strength": 0.5},
        loras=[LoraSpec(name="ember", scale=0.5)],
        preview=PreviewRequest(every_steps=2),
        checkpoint=CheckpointRequest(every_seconds=45.0),
        webhook=WebhookSpec(url="https://hooks.example.com/k"),
        speed="fast",
        metadata={"team": "a"},
        start_by=1.5e9,
    )
    stored = json.loads(json.dumps(full.encode()))  # as Redis gives it back
    assert stored["version"] == JOB_SPEC_VERSION
    assert JobSpec.decode(stored) == full
    # a batch item line stores the same encoding, byte for byte
    line = item_line(4, "c4", full)
    assert json.loads(line)["r"] == stored
    item = parse_item(line)
    assert (item.line, item.custom_id, item.spec) == (4, "c4", full)


def test_the_spec_of_a_request_keeps_every_value_and_needs_its_seed() -> None:
    request = JobRequest(prompt="waves", num_frames=5, seed=9, fps=12)
    made = JobSpec.of(request)
    assert (made.version, made.seed, made.output_format, made.fps) == (1, 9, "mp4", 12)
    # version 1: a field version 2 added (`checkpoint`) is not written while unset
    assert made.encode() == {
        **request.model_dump(mode="json", exclude={"checkpoint"}),
        "version": 1,
    }
    with pytest.raises(ValueError, match="seed"):
        JobSpec.of(JobRequest(prompt="no seed yet"))


@pytest.mark.parametrize("stored", [PREVIOUS_RELEASE, OLDER_RELEASE])
def test_a_record_without_a_version_decodes_as_version_1(stored: str) -> None:
    data = json.loads(stored)
    decoded = JobSpec.decode(data)
    assert decoded.version == 1
    # every stored value is read as stored; the fields it lacks take the contract's defaults
    assert {name: value for name, value in decoded.encode().items() if name in data} == data
    if "inputs" not in data:
        assert (decoded.inputs, decoded.loras, decoded.preview, decoded.speed) == (
            {}, [], None, "exact",
        )  # fmt: skip


def test_an_old_item_line_decodes() -> None:
    # the previous release wrote `{"n","c","r"}` with `r` unversioned
    raw = b'{"n":3,"c":"line-3","r":%s}' % OLDER_RELEASE.encode()
    item = parse_item(raw)
    assert (item.line, item.custom_id, item.spec.version, item.spec.seed) == (3, "line-3", 1, 7)


@pytest.mark.parametrize("version", [JOB_SPEC_VERSION + 1, 99])
def test_a_future_version_is_refused_naming_it(version: int) -> None:
    stored = {**spec().encode(), "version": version}
    with pytest.raises(JobSpecRefused, match=f"version {version}, newer than this release") as e:
        JobSpec.decode(stored)
    assert e.value.error() == {
        "type": JOB_SPEC_ERROR,
        "message": str(e.value),
        "retryable": False,
        "version": version,
    }
    with pytest.raises(JobSpecRefused):
        parse_item(b'{"n":1,"c":"c1","r":%s}' % json.dumps(stored).encode())


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None])
def test_a_version_that_is_not_one_is_refused(version: object) -> None:
    with pytest.raises(JobSpecRefused, match="is not a version"):
        JobSpec.decode({**spec().encode(), "version": version})


def test_a_spec_that_is_not_valid_is_refused_naming_the_field() -> None:
    stored = {**spec().encode(), "seed": None, "unknown": 1}
    with pytest.raises(JobSpecRefused, match=r"invalid: seed: .*unknown: Extra inputs"):
        JobSpec.decode(stored)


def test_the_view_shows_the_spec_without_its_version_and_a_newer_one_without_failing() -> None:
    stored = spec(pipeline="tiny").encode()
    view = job_view(record_of(stored))
    assert view.parameters.model_dump(mode="json") == {
        **{k: v for k, v in stored.items() if k != "version"},
        "checkpoint": None,  # the node's cadence: version 1 has no field for it
    }
    assert "version" not in view.model_dump(mode="json")["parameters"]
    # a newer release's spec (another API replica wrote it): shown as far as it is known
    newer = job_view(record_of({**stored, "version": 3, "a_new_field": True}))
    assert (newer.parameters.pipeline, newer.parameters.seed) == ("tiny", 3)


def test_a_dead_letter_whose_spec_is_newer_is_refused_by_redrive_not_a_500(api: Api) -> None:
    newer = {**spec(pipeline="tiny").encode(), "version": 3}
    owner = api.key_ids["alice"]
    record, _ = api.store.create_job(NewJob(id=uuid.uuid4().hex, request=newer, owner=owner))
    api.store.fail(record.id, None, JobSpecRefused("newer", 3).error())  # as a node fails it
    body = {"ids": [record.id], "rate": 100}
    got = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth())
    assert got.status_code == 200, got.text
    (item,) = got.json()["results"]
    assert item["outcome"] == "refused"
    assert "version 3, newer than this release" in item["message"]
    assert got.json()["redriven"] == 0


def test_a_spec_is_written_at_the_lowest_version_that_holds_its_fields() -> None:
    own = spec(checkpoint=CheckpointRequest(every_steps=5))
    assert own.version == 2
    stored = json.loads(json.dumps(own.encode()))
    assert (stored["version"], stored["checkpoint"]) == (
        2,
        {"every_steps": 5, "every_seconds": None},
    )
    assert JobSpec.decode(stored) == own
    assert parse_item(item_line(1, "c1", own)).spec == own
    plain = spec().encode()
    assert plain["version"] == 1  # what a version-1 node reads: no field it lacks
    assert "checkpoint" not in plain
    # a version-1 spec cannot carry a field version 2 added: refused by name, not guessed at
    with pytest.raises(JobSpecRefused, match="version 1 has no field checkpoint"):
        JobSpec.decode({**stored, "version": 1})


@pytest.mark.parametrize(
    "cadence",
    [
        {},
        {"every_steps": 5, "every_seconds": 60},
        {"every_steps": 0},
        {"every_steps": True},
        {"every_steps": "5"},
        {"every_steps": 10**30},
        {"every_seconds": 0.5},
        {"every_seconds": float("nan")},
        {"every_seconds": float("inf")},
        {"every_minutes": 1},
    ],
)
def test_a_cadence_that_is_not_exactly_one_valid_value_is_refused(cadence: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as refused:
        JobRequest.model_validate({"prompt": "a kiln", "checkpoint": cadence})
    assert refused.value.errors()[0]["loc"][0] == "checkpoint"


def test_a_hostile_cadence_over_http_is_a_422_naming_it(api: Api) -> None:
    for raw in (
        b'{"prompt":"x","checkpoint":{"every_seconds":NaN}}',
        b'{"prompt":"x","checkpoint":{"every_seconds":1e400}}',
        b'{"prompt":"x","checkpoint":{"every_steps":"\\ud800"}}',
        b'{"prompt":"x","checkpoint":7}',
    ):
        got = httpx.post(
            f"{api.url}/v1/jobs",
            content=raw,
            headers={**api.auth(), "content-type": "application/json"},
        )
        assert got.status_code == 422, (raw, got.text)
        assert "checkpoint" in json.dumps(got.json()["detail"]), got.text
