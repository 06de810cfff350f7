"""Quarantine: a node whose device fails different jobs stops taking work and says so."""

from __future__ import annotations

from kiln.common.states import JobState
from kiln.gpu_worker.errors import JobFailed, OutOfMemory, WorkerGroupDied
from kiln.tasks.cli.admin_nodes import node_state
from kiln.tasks.node.quarantine import Quarantine, is_device_error
from tests.tasks.node.conftest import NodeFactory

DIED = {"type": "WorkerGroupDied", "message": "the worker group died", "retryable": True}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_device_errors_are_group_deaths_and_what_the_device_raised_not_memory() -> None:
    assert is_device_error(DIED)
    assert is_device_error({"type": "RankStartupFailed", "message": "rank 1 failed"})
    cuda = "the pipeline failed: RuntimeError: CUDA error: an illegal memory access"
    assert is_device_error({"type": "JobFailed", "message": cuda})
    assert not is_device_error({"type": "OutOfMemory", "message": "Out of memory while ..."})
    assert not is_device_error({"type": "JobFailed", "message": "the pipeline failed: ValueError"})


def test_one_job_failing_again_and_again_never_quarantines() -> None:
    quarantine = Quarantine(jobs=3, window_s=60, clock=Clock())
    assert not any(quarantine.note("same-job", DIED) for _ in range(10))
    assert quarantine.reason is None
    assert quarantine.health() is None


def test_one_group_death_failing_a_whole_batch_is_one_failure() -> None:
    clock = Clock()
    quarantine = Quarantine(jobs=3, window_s=600, clock=clock)
    assert not any(quarantine.note(job, DIED) for job in "abcdef")  # one batch, one death
    clock.now = 30
    assert not any(quarantine.note(job, DIED) for job in "abc")  # the same batch, again
    assert quarantine.reason is None


def test_different_jobs_within_the_window_quarantine_for_good() -> None:
    clock = Clock()
    quarantine = Quarantine(jobs=3, window_s=60, clock=clock)
    assert not quarantine.note("a", DIED)
    clock.now = 61  # a's failure is out of the window now
    assert not quarantine.note("b", DIED)
    clock.now = 72
    assert not quarantine.note("c", {"type": "OutOfMemory", "message": "oom"})
    assert not quarantine.note("d", DIED)
    clock.now = 83
    assert quarantine.note("e", DIED)
    health = quarantine.health()
    assert health is not None
    assert "3 device failures of 3 different jobs" in health["reason"]
    clock.now = 10_000  # no way back but a restart
    assert not quarantine.note("f", {"type": "JobFailed", "message": "fine"})
    assert quarantine.reason is not None


def test_a_quarantined_node_takes_no_more_work_and_says_so(make_node: NodeFactory) -> None:
    harness = make_node(quarantine_jobs=2, max_attempts=1)
    node = harness.node
    clock = Clock()
    node.quarantine = Quarantine(jobs=2, window_s=600, clock=clock)
    for n in range(2):
        clock.now = 100.0 * n  # two separate deaths of the group, each under another job
        job_id = harness.submit()
        harness.coordinator.fail_with = WorkerGroupDied("rank 0 died")
        harness.deliver(job_id)
        assert harness.store.get(job_id).state == JobState.FAILED
    assert node.quarantine.reason is not None
    health = node.health()
    assert health["quarantined"] is not None
    assert node_state(health, []) == "quarantined"
    assert node.holds_back("interactive.tiny") == "the node is quarantined"
    # a delivery now runs nothing: the job stays queued, published again for another node
    harness.coordinator.fail_with = None
    later = harness.submit()
    ran_before, published_before = len(harness.coordinator.requests), len(harness.published)
    harness.deliver(later)
    record = harness.store.get(later)
    assert (record.state, record.attempts) == (JobState.QUEUED, 0)
    assert len(harness.coordinator.requests) == ran_before
    assert [p[0] for p in harness.published[published_before:]] == [later]


def test_failures_that_are_not_the_device_leave_the_node_serving(make_node: NodeFactory) -> None:
    harness = make_node(quarantine_jobs=2)
    for error in (OutOfMemory("too big"), JobFailed("a bug"), OutOfMemory("too big")):
        job_id = harness.submit()
        harness.coordinator.fail_with = error
        harness.deliver(job_id)
    assert harness.node.quarantine.reason is None
    assert harness.node.health()["quarantined"] is None
