"""Step checkpoints through a real worker group: rank 0 takes them, every rank resumes from one.

Real spawned CPU ranks (one, and two dividing the forward): a request with a `CheckpointPlan`
hands its checkpoints to `on_checkpoint`; a later request offered them resumes from the newest
valid one (passing over a damaged one, with the reason in its metrics), runs only the steps
left, and ends byte-identical to a run never interrupted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from kiln.common.request import CHECKPOINTS_KEY
from kiln.common.stops import StopReason
from kiln.gpu_worker.batching import plan_batch, window_remaining
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.errors import JobStopped
from kiln.gpu_worker.protocol import CheckpointPlan, GenerationResult, StepCheckpoint
from tests.gpu_worker.conftest import GENEROUS_S, request, start_coordinator

STEPS = 8
EVERY = 3
PIPELINES = {"tiny": "tiny", "video": "tiny-video"}
_ids = itertools.count()


@pytest.fixture(scope="module", params=["cpu:1", "cpu:2"])
def group(request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    # rank 0 always waits for the verdict on the step before: a stop lands at the step it is meant
    # for however late the coordinator's thread is on a loaded machine
    coordinator = start_coordinator(
        request.param, PIPELINES, node_name=f"ckpt-{request.param}", verdict_wait_s=GENEROUS_S
    )
    yield coordinator
    coordinator.shutdown()


def run(
    group: Coordinator, case: dict[str, object], plan: CheckpointPlan | None
) -> tuple[GenerationResult, list[StepCheckpoint]]:
    taken: list[StepCheckpoint] = []
    job = request(f"r{next(_ids)}", steps=STEPS, checkpoint=plan, **case)  # type: ignore[arg-type]
    result = group.submit(job, on_checkpoint=taken.append).result(timeout=GENEROUS_S)
    return result, taken


CASES = {
    "image, Euler": {"pipeline": "tiny"},
    "image, DPM-Solver": {
        "pipeline": "tiny",
        "extra_inputs": {"scheduler": "DPMSolverMultistepScheduler"},
    },
    "video, flow-matching Euler": {"pipeline": "video", "size": 32, "num_frames": 5},
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_rank_0_checkpoints_and_a_later_run_resumes_byte_identical(
    group: Coordinator, case: dict[str, object]
) -> None:
    uninterrupted, none_taken = run(group, case, None)
    assert none_taken == []

    checkpointed, taken = run(group, case, CheckpointPlan(every_steps=EVERY))
    assert [(c.steps_done, c.total) for c in taken] == [(3, STEPS), (6, STEPS)]
    assert checkpointed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()

    damaged = taken[-1].data[:-10]  # the newest, cut short: passed over for the one before
    offered = CheckpointPlan(resume=(damaged, taken[0].data), every_steps=EVERY)
    resumed, taken_again = run(group, case, offered)
    assert resumed.metrics is not None
    assert resumed.metrics.resumed_at_step == 3
    assert resumed.metrics.steps_run == STEPS - 3  # only the steps left were computed
    assert len(resumed.metrics.checkpoint_refusals) == 1
    assert "truncated" in resumed.metrics.checkpoint_refusals[0]
    assert resumed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()
    assert [c.steps_done for c in taken_again] == [6]  # the cadence counts from the resume
    assert taken_again[0].data == taken[1].data  # the same state as the first run's step 6


def test_a_checkpoint_of_another_request_is_refused_and_the_run_starts_at_0(
    group: Coordinator,
) -> None:
    case: dict[str, object] = {"pipeline": "tiny"}
    _, taken = run(group, case, CheckpointPlan(every_steps=EVERY))
    other: dict[str, object] = {"pipeline": "tiny", "seed": 2}
    uninterrupted, _ = run(group, other, None)
    resumed, _ = run(group, other, CheckpointPlan(resume=(taken[0].data,)))
    assert resumed.metrics is not None
    assert resumed.metrics.resumed_at_step == 0
    assert resumed.metrics.steps_run == STEPS
    assert "another pipeline identity" in resumed.metrics.checkpoint_refusals[0]
    assert resumed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()


def test_a_request_with_checkpoints_runs_alone() -> None:
    plan = CheckpointPlan(every_steps=EVERY)
    jobs = [request("a"), request("b", checkpoint=plan), request("c"), request("d")]
    queued = [SimpleNamespace(request=job, enqueued_at=0.0) for job in jobs]
    assert [q.request.request_id for q in plan_batch(queued, 8)] == ["a", "c", "d"]
    assert [q.request.request_id for q in plan_batch(queued[1:], 8)] == ["b"]
    assert window_remaining(plan_batch(queued[1:], 8), 8, window_s=5.0, now=0.0) == 0.0


VIDEO: dict[str, object] = {"pipeline": "video", "size": 32, "num_frames": 5}


class Stopping:
    """A video request with a plan but no cadence, asked to stop once step `after` is reported."""

    def __init__(self, group: Coordinator, reason: StopReason, after: int) -> None:
        self.steps: list[int] = []  # the denoising steps reported
        self.taken: list[StepCheckpoint] = []
        job = request(f"r{next(_ids)}", steps=STEPS, checkpoint=CheckpointPlan(), **VIDEO)  # type: ignore[arg-type]
        self.future = group.submit(
            job,
            on_progress=lambda p: self.steps.append(p.step) if p.stage == "denoising" else None,
            should_stop=lambda: reason if self.steps and self.steps[-1] >= after else None,
            on_checkpoint=self.taken.append,
        )


@pytest.mark.parametrize(
    ("reason", "checkpoints"), [(StopReason.HANDED_BACK, 1), (StopReason.CANCELED, 0)]
)
def test_a_handed_back_request_checkpoints_the_step_it_stops_at_whatever_the_cadence(
    group: Coordinator, reason: StopReason, checkpoints: int
) -> None:
    """A drain: the stop's own step is captured (the plan has no cadence); a cancel takes none."""
    uninterrupted, _ = run(group, VIDEO, None)
    stopping = Stopping(group, reason, after=3)
    with pytest.raises(JobStopped):
        stopping.future.result(timeout=GENEROUS_S)
    taken = stopping.taken
    assert len(taken) == checkpoints
    if not taken:
        return
    stopped_at = stopping.steps[-1]  # rank 0 reports the step it stops after, then stops
    assert 3 < stopped_at < STEPS
    assert taken[0].steps_done == stopped_at  # nothing it computed is lost
    resumed, _ = run(group, VIDEO, CheckpointPlan(resume=(taken[0].data,)))
    assert resumed.metrics is not None
    assert resumed.metrics.resumed_at_step == stopped_at
    assert resumed.metrics.steps_run == STEPS - stopped_at
    assert resumed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()


def test_a_hand_back_that_comes_at_the_last_step_lets_the_request_end(group: Coordinator) -> None:
    """The last step's state is the output: a drain there keeps it, not a checkpoint of it.

    The stop is asked as step STEPS - 1 is reported, so rank 0 reads it at the end of the last
    step. Stopped there, every step would be lost (no checkpoint is taken of the last step); the
    request goes on to its end instead, byte-identical to a run never stopped. A cancel there
    still stops it.
    """
    uninterrupted, _ = run(group, VIDEO, None)
    handed_back = Stopping(group, StopReason.HANDED_BACK, after=STEPS - 1)
    result = handed_back.future.result(timeout=GENEROUS_S)
    assert handed_back.steps[-1] == STEPS
    assert handed_back.taken == []  # no cadence, and the last step is never checkpointed
    assert result.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()

    canceled = Stopping(group, StopReason.CANCELED, after=STEPS - 1)
    with pytest.raises(JobStopped):
        canceled.future.result(timeout=GENEROUS_S)


def test_only_a_pipeline_that_resumes_announces_checkpoints_and_the_others_still_batch(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    """A plan on a pipeline whose loop cannot resume is dropped: its requests batch as before."""
    pipelines = {"tiny": "tiny", "painted": "python:tests.e2e.painted_pipelines:painted"}
    group = coordinator_factory("cpu:1", pipelines, node_name="ckpt-mixed", max_batch=4)
    assert group.pipeline_inputs()["tiny"][CHECKPOINTS_KEY] is True  # StableDiffusionPipeline
    assert group.pipeline_inputs()["painted"][CHECKPOINTS_KEY] is False  # a `python:` one
    assert group.takes_checkpoints("tiny")
    assert not group.takes_checkpoints("painted")
    plan = CheckpointPlan(every_seconds=0.01)
    # the busy one resumes (tiny): its plan is kept and it runs alone while the others queue up
    busy = group.submit(request("busy", "tiny", steps=20, checkpoint=plan))
    painted = [
        group.submit(request(f"painted-{n}", "painted", steps=4, seed=n, checkpoint=plan))
        for n in range(3)
    ]
    busy_result = busy.result(GENEROUS_S)
    assert busy_result.metrics is not None
    assert busy_result.metrics.batch_size == 1
    for future in painted:
        result = future.result(GENEROUS_S)
        assert result.metrics is not None
        assert result.metrics.batch_size == 3  # one forward for the three, plans or not
