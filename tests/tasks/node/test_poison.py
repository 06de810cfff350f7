"""Poison jobs on a real node (its group a stand-in): which failures make a job poison, and not."""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.gpu_worker.errors import JobFailed, OutOfMemory, WorkerGroupDied
from kiln.storage.dead_letters import DeadLetterStore
from tests.tasks.node.conftest import NodeFactory, NodeHarness


def run_with(harness: NodeHarness, job_id: str, error: Exception) -> None:
    harness.coordinator.fail_with = error
    harness.deliver(job_id)


def test_out_of_memory_is_poison_at_once_and_dead_lettered(harness: NodeHarness) -> None:
    job_id = harness.submit()
    run_with(harness, job_id, OutOfMemory("too big"))
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 1)
    assert record.error is not None
    assert (record.error["type"], record.error["poison"]) == ("OutOfMemory", "out_of_memory")
    letter = DeadLetterStore(harness.store.redis, harness.store.settings).get(job_id)
    assert letter is not None
    assert letter.poison == "out_of_memory"
    assert [a["error"]["type"] for a in letter.attempt_log] == ["OutOfMemory"]


@pytest.mark.parametrize(
    "second",
    [JobFailed("flaky", retryable=True), JobFailed("a bug"), OutOfMemory("too big")],
)
def test_a_group_death_and_another_failure_are_not_two_group_deaths(
    make_node: NodeFactory, second: Exception
) -> None:
    harness = make_node(max_attempts=5)
    job_id = harness.submit()
    run_with(harness, job_id, WorkerGroupDied("rank 1 died"))
    run_with(harness, job_id, second)
    record = harness.store.get(job_id)
    assert record.error is not None
    assert record.error.get("poison") != "group_broken_twice"


def test_two_group_deaths_apart_still_make_it_poison(make_node: NodeFactory) -> None:
    harness = make_node(max_attempts=5)
    job_id = harness.submit()
    run_with(harness, job_id, WorkerGroupDied("rank 1 died"))
    run_with(harness, job_id, JobFailed("flaky", retryable=True))
    run_with(harness, job_id, WorkerGroupDied("rank 0 died"))
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 3)
    assert record.error is not None
    assert record.error["poison"] == "group_broken_twice"
