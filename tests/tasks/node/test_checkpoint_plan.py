"""Which jobs a node plans step checkpoints for (tasks/node/checkpoints.py `checkpoint_plan`).

A job whose request names a cadence gets it, image or video; another video job on a pipeline that
announced checkpoints gets the node's cadence; another image job none; a job
of a pipeline whose loop cannot resume gets no plan at all (offered checkpoints or not), so its
group batches it with others as before. A job whose record names no checkpoint (most jobs) runs
without a read of them.
"""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.gpu_worker.protocol import CheckpointPlan
from kiln.storage import checkpoints as stored_checkpoints
from kiln.storage.base import StoreBase
from kiln.storage.checkpoints import CheckpointRef
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import CheckpointRequest, JobRequest
from kiln.tasks.node.checkpoints import checkpoint_plan
from tests.tasks.node.conftest import NodeHarness


def spec(num_frames: int) -> JobSpec:
    return JobSpec.of(
        JobRequest(
            pipeline="video", prompt="a kiln", num_frames=num_frames, width=64, height=64, seed=1
        )
    )


def test_a_video_on_a_pipeline_that_resumes_takes_checkpoints_an_image_none() -> None:
    assert checkpoint_plan(spec(17), (), 30.0, resumable=True) == CheckpointPlan(every_seconds=30.0)
    assert checkpoint_plan(spec(1), (), 30.0, resumable=True) is None
    assert checkpoint_plan(spec(1), (b"x",), 30.0, resumable=True) == CheckpointPlan(resume=(b"x",))
    assert checkpoint_plan(spec(17), (), 0.0, resumable=True) is None  # turned off


def test_a_pipeline_that_cannot_resume_gets_no_plan() -> None:
    assert checkpoint_plan(spec(17), (), 30.0, resumable=False) is None
    assert checkpoint_plan(spec(17), (b"x",), 30.0, resumable=False) is None


def test_a_request_s_own_cadence_is_its_plan_image_or_video() -> None:
    by_steps = JobSpec.of(
        JobRequest(prompt="a kiln", seed=1, checkpoint=CheckpointRequest(every_steps=5))
    )
    assert checkpoint_plan(by_steps, (), 30.0, resumable=True) == CheckpointPlan(every_steps=5)
    # the node's cadence turned off does not turn off the request's own
    assert checkpoint_plan(by_steps, (b"x",), 0.0, resumable=True) == CheckpointPlan(
        resume=(b"x",), every_steps=5
    )
    video = spec(17).model_copy(update={"checkpoint": CheckpointRequest(every_seconds=90.0)})
    assert checkpoint_plan(video, (), 30.0, resumable=True) == CheckpointPlan(every_seconds=90.0)
    # a pipeline whose loop cannot resume: no plan, whatever the request asked
    assert checkpoint_plan(by_steps, (), 30.0, resumable=False) is None


def test_a_job_whose_record_names_no_checkpoint_runs_without_reading_them(
    harness: NodeHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []
    recorded = stored_checkpoints.recorded_checkpoints

    def counted(store: StoreBase, job_id: str) -> list[CheckpointRef]:
        read.append(job_id)
        return recorded(store, job_id)

    monkeypatch.setattr(stored_checkpoints, "recorded_checkpoints", counted)
    job_id = harness.submit()
    harness.deliver(job_id)
    assert harness.store.get(job_id).state == JobState.SUCCEEDED
    assert read == []  # neither to offer any to its group nor to delete them once it succeeded
