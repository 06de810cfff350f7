"""A node's part of a pause: a running job stops at its next step and is paused, not failed.

A node on real Redis with a fake worker group (tests/tasks/node/conftest.py): the pause comes
through the store as the API writes it, and the node's own cancel watch reads it.
"""

from __future__ import annotations

from kiln.common.states import JobState
from kiln.gpu_worker.errors import JobFailed
from kiln.tasks.node.maintenance import watch_cancels
from tests.tasks.node.conftest import STEPS, NodeHarness


def test_a_running_job_asked_to_pause_stops_at_its_next_step_and_is_paused(
    harness: NodeHarness,
) -> None:
    job_id = harness.submit()
    ran: list[int] = []

    def on_step(step: int) -> None:
        ran.append(step)
        if step == 2:
            harness.store.pause(job_id)  # what POST /v1/jobs/{id}/pause writes
            watch_cancels(harness.node)  # the node's cancel watch, one poll

    harness.coordinator.on_step = on_step
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert record.state == JobState.PAUSED
    assert ran == [1, 2]  # it stopped at the end of the step the pause came in
    assert STEPS > 2
    assert record.attempts == 0  # its run is not counted
    assert harness.store.lease_owner(job_id) is None  # its lease is released
    assert harness.published == []  # nothing to run: no message until it is resumed
    assert harness.event_types(job_id)[-1] == "paused"

    harness.coordinator.on_step = lambda _step: None
    resumed = harness.store.resume(job_id)
    assert resumed.state == JobState.QUEUED
    harness.deliver(job_id)
    done = harness.store.get(job_id)
    assert done.state == JobState.SUCCEEDED
    assert done.attempts == 1


def test_a_pause_pending_when_an_attempt_fails_retryably_pauses_it(
    harness: NodeHarness,
) -> None:
    job_id = harness.submit()

    def pause_at_step_1(step: int) -> None:
        if step == 1:
            harness.store.pause(job_id)

    harness.coordinator.on_step = pause_at_step_1
    harness.coordinator.fail_with = JobFailed("flaky", retryable=True)
    harness.deliver(job_id)  # no cancel watch ran: the failure ends the run first
    assert harness.store.get(job_id).state == JobState.PAUSED
    assert harness.published == []  # paused, not published for a retry
