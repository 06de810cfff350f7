"""A delivery decodes its job's spec once; a record of the previous release runs, a newer one fails.

On real Redis and a real local object store, with a fake worker group (tests/tasks/node/conftest).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from kiln.common.states import JobState
from kiln.storage.job_store import NewJob
from kiln.tasks.contract.job_spec import JOB_SPEC_ERROR, JobSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node import compute
from tests.tasks.node.conftest import PIPELINE, STEPS, NodeHarness

# A record's `request` as the previous release stored it in Redis: no `version`
PREVIOUS_RELEASE = json.loads(
    '{"pipeline":"tiny","prompt":"a kiln","negative_prompt":null,"width":64,"height":64,'
    '"num_frames":1,"fps":8,"steps":4,"guidance_scale":3.5,"seed":1234,"num_outputs":1,'
    '"output_format":"webp","priority":"interactive","webhook":null,"start_by":null,'
    '"max_run_seconds":30.0,"metadata":{},"inputs":{},"preview":null,"loras":[],'
    '"speed":"exact"}'
)


def create(harness: NodeHarness, stored: dict[str, Any]) -> str:
    """A queued job whose record stores `stored` as its request, as written by some release."""
    job_id = uuid.uuid4().hex
    harness.store.create_job(NewJob(id=job_id, request=stored))
    return job_id


def test_a_record_of_the_previous_release_runs_as_it_was_stored(harness: NodeHarness) -> None:
    assert (PREVIOUS_RELEASE["pipeline"], PREVIOUS_RELEASE["steps"]) == (PIPELINE, STEPS)
    job_id = create(harness, PREVIOUS_RELEASE)
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.error) == (JobState.SUCCEEDED, None)
    (ran,) = harness.coordinator.requests
    assert (ran.seed, ran.guidance_scale, ran.steps) == (1234, 3.5, STEPS)
    assert record.outputs[0]["key"].endswith(".webp")  # its recorded output format


@pytest.mark.parametrize("version", [3, 7])  # this release reads 1 and 2
def test_a_newer_spec_fails_for_good_naming_the_version_and_nothing_runs(
    harness: NodeHarness, version: int
) -> None:
    request = JobRequest(pipeline=PIPELINE, prompt="a kiln", width=64, height=64, seed=1)
    job_id = create(harness, {**JobSpec.of(request).encode(), "version": version})
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 0)
    assert record.error is not None
    assert (record.error["type"], record.error["retryable"]) == (JOB_SPEC_ERROR, False)
    assert record.error["version"] == version
    assert f"version {version}, newer than this release" in record.error["message"]
    assert harness.event_types(job_id) == ["queued", "failed"]
    assert harness.coordinator.requests == []
    assert harness.published == []  # not retried: no release of this node reads it later
    assert harness.store.lease_owner(job_id) is None


def test_a_delivery_decodes_the_spec_and_builds_the_group_request_once(
    harness: NodeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    decodes: list[str] = []
    builds: list[str] = []
    decode, build = JobSpec.decode.__func__, compute.generation_request  # type: ignore[attr-defined]

    def counted_decode(cls: type[JobSpec], stored: dict[str, Any]) -> JobSpec:
        decodes.append("decode")
        return decode(cls, stored)  # type: ignore[no-any-return]

    def counted_build(job_id: str, spec: JobSpec) -> Any:
        builds.append(job_id)
        return build(job_id, spec)

    monkeypatch.setattr(JobSpec, "decode", classmethod(counted_decode))
    monkeypatch.setattr(compute, "generation_request", counted_build)
    job_id = harness.submit(preview={"every_steps": 2}, max_run_seconds=60.0)
    harness.deliver(job_id)
    assert harness.store.get(job_id).state == JobState.SUCCEEDED
    assert (decodes, builds) == (["decode"], [job_id])
