"""Step checkpoints of a `python:` pipeline through its save/restore hooks, in a real group.

Real spawned CPU ranks (one, and two running the same loop) serving the fixture pipeline
`tests/e2e/resumable_pipeline.py` as a `python:` spec, loaded by the real loading code: it
announces checkpoints, rank 0 takes them at the plan's cadence from `save_state`, and a later
request offered them resumes through `restore_state` from the newest valid one, runs only the
steps left and ends byte-identical to a run never interrupted. A state the hook refuses, or one
`save_state` cannot give, costs the checkpoint, never the job.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from kiln.common.request import CHECKPOINTS_KEY
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.pipelines.step_checkpoint import decode, encode, read_header
from kiln.gpu_worker.protocol import CheckpointPlan, GenerationResult, StepCheckpoint
from tests.e2e.resumable_pipeline import UNSAVEABLE
from tests.gpu_worker.conftest import GENEROUS_S, request

STEPS = 8
EVERY = 3
PIPELINES = {
    "drifting": "python:tests.e2e.resumable_pipeline:make",
    "sleepy": "python:tests.e2e.pipelines:sleepy",
}
_ids = itertools.count()


@pytest.fixture(scope="module", params=["cpu:1", "cpu:2"])
def group(request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    from tests.gpu_worker.conftest import start_coordinator

    coordinator = start_coordinator(request.param, PIPELINES, node_name=f"hooks-{request.param}")
    yield coordinator
    coordinator.shutdown()


def run(
    group: Coordinator, plan: CheckpointPlan | None, prompt: str = "a red kiln"
) -> tuple[GenerationResult, list[StepCheckpoint]]:
    taken: list[StepCheckpoint] = []
    job = request(f"h{next(_ids)}", "drifting", prompt, steps=STEPS, checkpoint=plan)
    result = group.submit(job, on_checkpoint=taken.append).result(timeout=GENEROUS_S)
    return result, taken


def test_a_pipeline_with_the_hooks_announces_checkpoints_and_one_without_does_not(
    group: Coordinator,
) -> None:
    schemas = group.pipeline_inputs()
    assert schemas["drifting"][CHECKPOINTS_KEY] is True
    assert schemas["sleepy"][CHECKPOINTS_KEY] is False


def test_rank_0_saves_the_hooks_state_and_a_later_run_resumes_byte_identical(
    group: Coordinator,
) -> None:
    uninterrupted, none_taken = run(group, None)
    assert none_taken == []

    checkpointed, taken = run(group, CheckpointPlan(every_steps=EVERY))
    assert [(c.steps_done, c.total) for c in taken] == [(3, STEPS), (6, STEPS)]
    assert checkpointed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()

    damaged = taken[-1].data[:-10]  # the newest, cut short: passed over for the one before
    resumed, taken_again = run(
        group, CheckpointPlan(resume=(damaged, taken[0].data), every_steps=EVERY)
    )
    assert resumed.metrics is not None
    assert resumed.metrics.resumed_at_step == 3
    assert resumed.metrics.steps_run == STEPS - 3  # only the steps left were computed
    assert len(resumed.metrics.checkpoint_refusals) == 1
    assert "truncated" in resumed.metrics.checkpoint_refusals[0]
    assert resumed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()
    assert [c.steps_done for c in taken_again] == [6]
    assert taken_again[0].data == taken[1].data  # the same state as the first run's step 6


def test_a_state_the_hook_refuses_runs_from_step_0_and_the_job_succeeds(
    group: Coordinator,
) -> None:
    uninterrupted, taken = run(group, CheckpointPlan(every_steps=EVERY))
    header, _ = read_header(taken[0].data)
    state = decode(taken[0].data, header["identity"])
    del state.loop["latents"]  # a valid checkpoint object whose state the pipeline cannot use
    offered = CheckpointPlan(resume=(encode(state),))
    resumed, _ = run(group, offered)
    assert resumed.metrics is not None
    assert resumed.metrics.resumed_at_step == 0
    assert resumed.metrics.steps_run == STEPS
    (refusal,) = resumed.metrics.checkpoint_refusals
    assert (
        "restore_state refused the state after step 3: ValueError: the state has no latents"
        in refusal
    )
    assert resumed.outputs[0].tobytes() == uninterrupted.outputs[0].tobytes()


def test_a_state_save_state_cannot_give_costs_the_checkpoint_not_the_job(
    group: Coordinator,
) -> None:
    result, taken = run(group, CheckpointPlan(every_steps=EVERY), prompt=UNSAVEABLE)
    assert taken == []
    assert result.outputs[0].shape == (1, 64, 64, 3)
