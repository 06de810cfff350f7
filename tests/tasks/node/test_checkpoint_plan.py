"""Which jobs a node plans step checkpoints for (tasks/node/checkpoints.py `checkpoint_plan`).

A video job on a pipeline that announced checkpoints gets the cadence; an image job none; a job
of a pipeline whose loop cannot resume gets no plan at all (offered checkpoints or not), so its
group batches it with others as before.
"""

from __future__ import annotations

from kiln.gpu_worker.protocol import CheckpointPlan
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.checkpoints import checkpoint_plan


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
