"""What the group runs for a job is the job's recorded, effective request."""

from __future__ import annotations

import time

from kiln.common.states import JobState
from kiln.storage.job_store import JobRecord
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.compute import DeliveredJob


def record_of(request: JobRequest) -> JobRecord:
    """A queued record holding `request` as submission stores it."""
    return JobRecord(
        id="a" * 32, state=JobState.QUEUED, request=request.to_record(), lane="interactive",
        owner=None, created_at=time.time(), started_at=None, finished_at=None, attempts=0,
        progress=None, outputs=[], error=None, metrics={}, batch_id=None, metadata={},
        published=True,
    )  # fmt: skip


def test_the_group_gets_the_contracts_defaults_as_recorded() -> None:
    ran = DeliveredJob.decode(record_of(JobRequest(prompt="a fox", seed=3))).compute
    assert ran.guidance_scale == JobRequest.model_fields["guidance_scale"].default
    assert (ran.num_frames, ran.num_outputs, ran.seed) == (1, 1, 3)


def test_the_group_gets_the_requests_own_values() -> None:
    request = JobRequest(
        prompt="waves", pipeline="tiny-video", width=64, height=96, num_frames=5, steps=3,
        guidance_scale=0.0, seed=9, num_outputs=2, negative_prompt="blur",
    )  # fmt: skip
    ran = DeliveredJob.decode(record_of(request)).compute
    assert (ran.pipeline, ran.width, ran.height, ran.num_frames, ran.steps) == (
        "tiny-video", 64, 96, 5, 3,
    )  # fmt: skip
    assert (ran.guidance_scale, ran.seed, ran.num_outputs, ran.negative_prompt) == (
        0.0, 9, 2, "blur",
    )  # fmt: skip
