"""`JobRunner`: every way one delivery of `run_job` can go.

On real Redis and a real local object store, with a fake worker group. Each test checks the
record (state, attempts, error), its events, what the group ran and what was published.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest

from kiln.common.accounting import StepAccounting
from kiln.common.states import JobState
from kiln.gpu_worker.errors import JobFailed, WorkerGroupDied
from kiln.storage.job_store import JobStore
from kiln.tasks.node import jobs
from kiln.tasks.node.maintenance import renew_leases, watch_cancels
from kiln.tasks.queue.app import RUN_JOB_TASK, make_celery_app
from kiln.tasks.webhooks import event_sink
from tests.tasks.node.conftest import QUEUE, STEPS, NodeFactory, NodeHarness, wait_until_expired

# held first: still queued, its progress `waiting_in_node`; running once the group starts it;
# progress: encoding, uploading; then the one output is announced before the end
RAN = ["queued", "progress", "running", "progress", "progress", "output", "succeeded"]
WAITING = {"stage": "waiting_in_node", "node": "node-under-test", "position": 0}


def start_elsewhere(store: JobStore, job_id: str, owner: str = "other-node/1") -> int:
    """Another node leases and starts the job; returns its lease token."""
    token = store.acquire_lease(job_id, owner)
    store.start(job_id, token, node_id=owner.split("/")[0])
    return token


def test_a_queued_job_runs_and_succeeds_with_verified_outputs(harness: NodeHarness) -> None:
    job_id = harness.submit(guidance_scale=3.5, fps=12)
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts, record.error) == (JobState.SUCCEEDED, 1, None)
    assert harness.event_types(job_id) == RAN
    assert harness.events(job_id)[1].payload == WAITING
    assert harness.events(job_id)[2].payload["node_id"] == "node-under-test"
    (key,) = [o["key"] for o in record.outputs]
    assert re.fullmatch(rf"{job_id}/1-[0-9a-f]{{8}}/0\.png", key)  # the attempt's own folder
    assert harness.node.objects.head(record.outputs[0]["key"]) is not None
    assert {"queue_s", "encode_s", "upload_s"} <= set(record.metrics)
    assert record.started_at is not None  # queue_s runs from creation to the group's start
    assert record.metrics["queue_s"] == round(record.started_at - record.created_at, 4)
    assert harness.published == []
    (ran,) = harness.coordinator.requests  # the recorded request, read without node defaults
    assert (ran.guidance_scale, ran.seed, ran.steps) == (3.5, 7, STEPS)
    assert harness.store.lease_owner(job_id) is None  # released


def test_a_job_without_webhooks_is_told_running_by_the_thread_that_starts_it(
    harness: NodeHarness,
) -> None:
    heard: list[tuple[str, str]] = []  # the node's listeners: (event, the thread telling it)
    harness.node.events.add_listener(
        lambda note: heard.append((note.type, threading.current_thread().name))
    )
    job_id = harness.submit()
    harness.deliver(job_id)  # the fake group starts its batch on this thread
    here = threading.current_thread().name
    assert ("running", here) in heard  # no handoff to another thread as its batch leaves
    assert [event for event, _ in heard if event in ("running", "succeeded")] == [
        "running",
        "succeeded",
    ]


@pytest.mark.parametrize("end", ["canceled", "succeeded"])
def test_a_finished_job_is_acked_and_nothing_runs(harness: NodeHarness, end: str) -> None:
    job_id = harness.submit()
    if end == "canceled":
        harness.store.cancel(job_id)
    else:
        harness.deliver(job_id)
    before = harness.store.get(job_id)
    events_before = harness.event_types(job_id)
    requests_before = len(harness.coordinator.requests)

    harness.deliver(job_id)

    after = harness.store.get(job_id)
    assert (after.state, after.attempts) == (before.state, before.attempts)
    assert after.state == end
    assert harness.event_types(job_id) == events_before
    assert len(harness.coordinator.requests) == requests_before
    assert harness.published == []


def test_a_job_that_no_longer_exists_is_dropped(harness: NodeHarness) -> None:
    harness.deliver("0" * 32)
    assert harness.coordinator.requests == []
    assert harness.published == []


def test_a_queued_job_leased_elsewhere_is_published_again_later(harness: NodeHarness) -> None:
    job_id = harness.submit()
    harness.store.acquire_lease(job_id, "other-node/1")  # it is about to start it
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.QUEUED, 0)
    assert harness.event_types(job_id) == ["queued"]
    assert harness.coordinator.requests == []
    delay = harness.node.settings.lease_busy_delay_s
    assert harness.published == [(job_id, QUEUE, delay)]
    assert harness.store.lease_owner(job_id) == "other-node/1"


def test_delivered_while_running_under_a_live_lease_is_published_again_later(
    harness: NodeHarness,
) -> None:
    job_id = harness.submit()
    start_elsewhere(harness.store, job_id)
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.RUNNING, 1)
    assert harness.event_types(job_id) == ["queued", "running"]
    assert harness.coordinator.requests == []
    assert harness.published == [(job_id, QUEUE, harness.node.settings.lease_busy_delay_s)]
    assert harness.store.lease_owner(job_id) == "other-node/1"


def test_delivered_while_running_after_the_lease_expired_is_reaped_and_taken_over(
    harness: NodeHarness, job_store: JobStore
) -> None:
    job_id = harness.submit()
    short = JobStore(job_store.redis, job_store.settings.model_copy(update={"lease_ttl_s": 0.05}))
    start_elsewhere(short, job_id)  # ...and that node died: its lease lapses
    wait_until_expired(harness.store, job_id)

    harness.deliver(job_id)

    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.SUCCEEDED, 2)
    events = harness.events(job_id)
    assert [e.type for e in events] == ["queued", "running", "queued", *RAN[1:]]
    assert events[2].payload["reason"] == "lease_expired"
    assert events[3].payload == WAITING
    assert events[4].payload["node_id"] == "node-under-test"
    assert len(harness.coordinator.requests) == 1
    assert harness.published == []  # run here and now, not re-published


def test_a_job_past_its_start_by_expires_without_running(harness: NodeHarness) -> None:
    job_id = harness.submit(start_by=time.time() - 1)
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.EXPIRED, 0)
    assert harness.event_types(job_id) == ["queued", "expired"]
    assert harness.coordinator.requests == []
    assert harness.published == []


def test_a_job_out_of_attempts_fails_without_running(make_node: NodeFactory) -> None:
    harness = make_node(max_attempts=2)
    job_id = harness.submit()
    for _ in range(2):  # two runs that were handed back or reaped
        token = start_elsewhere(harness.store, job_id)
        harness.store.requeue(job_id, token, {"type": "handed_back", "retryable": True})
        harness.store.release_lease(job_id, token)

    harness.deliver(job_id)

    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 2)
    assert record.error is not None
    assert (record.error["type"], record.error["retryable"]) == ("max_attempts_exceeded", False)
    assert harness.event_types(job_id) == ["queued", *["running", "queued"] * 2, "failed"]
    assert harness.coordinator.requests == []
    assert harness.published == []


def test_a_job_over_the_nodes_limits_fails_for_good_before_starting(
    make_node: NodeFactory,
) -> None:
    harness = make_node(limits={"tiny": {"max_steps": STEPS - 1}})
    job_id = harness.submit()
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 0)
    assert record.error is not None
    assert record.error["type"] == "pipeline_limit"
    assert (record.error["limit"], record.error["retryable"]) == ("max_steps", False)
    assert record.error["message"].startswith("steps: ")
    assert harness.event_types(job_id) == ["queued", "failed"]
    assert harness.coordinator.requests == []
    assert harness.published == []


def test_a_cancel_stops_the_job_at_its_next_step(harness: NodeHarness) -> None:
    job_id = harness.submit()

    def cancel_at_step_two(step: int) -> None:
        if step == 2:
            harness.store.cancel(job_id)  # the API's cancel: a flag on the running job
            watch_cancels(harness.node)  # one pass of the node's cancel watch

    harness.coordinator.on_step = cancel_at_step_two
    harness.deliver(job_id)

    record = harness.store.get(job_id)
    assert (record.state, record.attempts, record.outputs) == (JobState.CANCELED, 1, [])
    events = harness.events(job_id)
    assert [e.type for e in events] == ["queued", "progress", "running", "canceled"]
    # the node's own report of its attempt: it stopped after step 2 of its run
    ran = StepAccounting(steps_computed=2).model_dump()
    ledger = record.ledger.model_dump()  # its ledger (kiln/common/ledger.py) as the record's
    assert events[-1].payload == {"reason": "requested", "accounting": ran, "ledger": ledger}
    assert harness.published == []
    assert harness.store.lease_owner(job_id) is None


def test_a_job_handed_back_at_drain_is_requeued_and_published(harness: NodeHarness) -> None:
    job_id = harness.submit()
    harness.coordinator.on_step = lambda step: harness.node.hand_back_all() if step == 2 else None
    harness.deliver(job_id)

    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.QUEUED, 1)
    assert record.error is not None
    assert (record.error["type"], record.error["retryable"]) == ("handed_back", True)
    events = harness.events(job_id)
    assert [e.type for e in events] == ["queued", "progress", "running", "queued"]
    assert events[-1].payload["reason"] == "retry"
    assert harness.published == [(job_id, QUEUE, 0.0)]
    assert harness.store.lease_owner(job_id) is None


def test_a_delivery_during_the_drain_is_handed_back_at_once(harness: NodeHarness) -> None:
    job_id = harness.submit()
    harness.node.draining.set()
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    # held, never started: back in its queue with no attempt spent, waiting in no node
    assert (record.state, record.attempts, record.error, record.progress) == (
        JobState.QUEUED,
        0,
        None,
        None,
    )
    assert harness.event_types(job_id) == ["queued", "progress"]
    assert harness.coordinator.requests == []  # the group never ran it
    assert harness.published == [(job_id, QUEUE, 0.0)]
    assert harness.store.lease_owner(job_id) is None


def test_a_job_whose_lease_was_lost_is_left_to_the_new_holder(harness: NodeHarness) -> None:
    job_id = harness.submit()

    def taken_over_at_step_two(step: int) -> None:
        if step != 2:
            return
        (tracked,) = harness.node.tracked_jobs()
        harness.store.release_lease(job_id, tracked.lease_token)  # as if it lapsed...
        harness.store.acquire_lease(job_id, "other-node/1")  # ...and another node took it
        renew_leases(harness.node)  # the heartbeat finds out

    harness.coordinator.on_step = taken_over_at_step_two
    harness.deliver(job_id)

    record = harness.store.get(job_id)
    assert (record.state, record.attempts, record.outputs) == (JobState.RUNNING, 1, [])
    # no write of ours after that
    assert harness.event_types(job_id) == ["queued", "progress", "running"]
    assert harness.published == []
    assert harness.store.lease_owner(job_id) == "other-node/1"


def renewal_failures(harness: NodeHarness) -> float:
    metrics = harness.node.metrics
    value = metrics.registry.get_sample_value(
        "kiln_node_lease_renewal_failures_total", {"node_id": harness.node.node_id}
    )
    assert value is not None
    return value


def test_a_renewal_just_after_the_jobs_own_end_is_no_failure(harness: NodeHarness) -> None:
    ended, lost = harness.submit(), harness.submit()
    held = {}
    for job_id in (ended, lost):
        token, _ = harness.store.hold(job_id, "n/1", harness.node.node_id, 0)
        harness.store.start(job_id, token, node_id=harness.node.node_id)
        held[job_id] = token
    with (
        harness.node.tracking(ended, held[ended]) as ended_tracked,
        harness.node.tracking(lost, held[lost]) as lost_tracked,
    ):
        # the job's last transition drops the lease a moment before it leaves the tracked set
        harness.store.succeed(ended, held[ended], [], {})
        renew_leases(harness.node)
        assert renewal_failures(harness) == 0
        assert ended_tracked.stop_reason is not None  # nothing left to compute
        assert lost_tracked.stop_reason is None
        harness.store.release_lease(lost, held[lost])  # lapsed, and another node took it
        harness.store.acquire_lease(lost, "other-node/1")
        renew_leases(harness.node)
        assert renewal_failures(harness) == 1
        assert lost_tracked.stop_reason is not None


def test_a_retryable_failure_requeues_with_backoff(harness: NodeHarness) -> None:
    job_id = harness.submit()
    harness.coordinator.fail_with = WorkerGroupDied("rank 1 died")
    harness.deliver(job_id)

    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.QUEUED, 1)
    assert record.error == {"type": "WorkerGroupDied", "message": "rank 1 died", "retryable": True}
    events = harness.events(job_id)
    assert [e.type for e in events] == ["queued", "progress", "running", "queued"]
    ran = StepAccounting(steps_computed=4).model_dump()  # every step, then the group died
    ledger = record.ledger.model_dump()
    assert events[-1].payload == {
        "reason": "retry",
        "error": record.error,
        "accounting": ran,
        "ledger": ledger,
    }
    ((published_id, queue, countdown),) = harness.published
    assert (published_id, queue) == (job_id, QUEUE)
    backoff = harness.node.settings.retry_backoff_s  # attempt 1: between d/2 and d
    assert backoff / 2 <= countdown <= backoff

    # the retry: the next attempt, with a doubled backoff (another kind of failure: a second
    # group death would make the job poison)
    harness.coordinator.fail_with = JobFailed("flaky", retryable=True)
    harness.deliver(job_id)
    assert (harness.store.get(job_id).attempts, len(harness.coordinator.requests)) == (2, 2)
    assert backoff <= harness.published[-1][2] <= 2 * backoff


def test_a_job_that_breaks_its_group_twice_is_poison_and_never_runs_again(
    harness: NodeHarness,
) -> None:
    job_id = harness.submit()
    harness.coordinator.fail_with = WorkerGroupDied("rank 1 died")
    harness.deliver(job_id)
    harness.deliver(job_id)  # attempts are left (KILN_MAX_ATTEMPTS 3), but not for this job
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 2)
    assert record.error == {
        "type": "WorkerGroupDied",
        "message": "rank 1 died",
        "retryable": False,
        "poison": "group_broken_twice",
    }
    assert len(harness.published) == 1  # the first retry only: nothing re-publishes it
    assert len(harness.coordinator.requests) == 2


def test_a_retryable_failure_on_the_last_attempt_fails_for_good(make_node: NodeFactory) -> None:
    harness = make_node(max_attempts=1)
    job_id = harness.submit()
    harness.coordinator.fail_with = WorkerGroupDied("rank 1 died")
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 1)
    assert record.error == {"type": "WorkerGroupDied", "message": "rank 1 died", "retryable": False}
    assert harness.event_types(job_id) == ["queued", "progress", "running", "failed"]
    assert harness.published == []


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (JobFailed("the pipeline refused the prompt"), "JobFailed"),
        (RuntimeError("a bug"), "RuntimeError"),  # unexpected: fails, never loops
    ],
)
def test_a_non_retryable_failure_fails_the_job(
    harness: NodeHarness, error: Exception, expected: str
) -> None:
    job_id = harness.submit()
    harness.coordinator.fail_with = error
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.FAILED, 1)
    assert record.error == {"type": expected, "message": str(error), "retryable": False}
    assert harness.event_types(job_id) == ["queued", "progress", "running", "failed"]
    assert harness.published == []
    assert harness.store.lease_owner(job_id) is None


@pytest.mark.parametrize("path", ["succeeds", "expires"])
def test_a_webhook_enqueue_that_raises_never_changes_the_outcome(
    harness: NodeHarness, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    attempted: list[str] = []

    def broken_enqueue(_store: JobStore, _job_id: str, event: str, **_: Any) -> None:
        attempted.append(event)
        raise RuntimeError("webhook queue down")

    # every webhook of a node's job, a pre-attempt end's included, is queued by its sink
    monkeypatch.setattr(event_sink, "enqueue_webhook_events", broken_enqueue)
    hook = {"url": "https://hooks.example.com/kiln", "events": ["started", "completed"]}
    if path == "succeeds":
        job_id = harness.submit(webhook=hook)
    else:
        job_id = harness.submit(webhook=hook, start_by=time.time() - 1)
    harness.deliver(job_id)

    record = harness.store.get(job_id)
    if path == "succeeds":
        assert (record.state, record.attempts) == (JobState.SUCCEEDED, 1)
        assert harness.event_types(job_id) == RAN
        assert attempted[0] == "started"
        assert attempted[-1] == "completed"
    else:
        assert (record.state, record.attempts) == (JobState.EXPIRED, 0)
        assert harness.event_types(job_id) == ["queued", "expired"]
        assert attempted == ["completed"]
    assert harness.published == []


def test_run_job_is_registered_bound_to_its_node_on_that_app_only(
    harness: NodeHarness,
) -> None:
    app = harness.node.celery_app
    jobs.register_run_job(app, harness.node)
    job_id = harness.submit()

    app.tasks[RUN_JOB_TASK](job_id)  # what the worker calls for a delivery

    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.SUCCEEDED, 1)
    assert harness.events(job_id)[2].payload["node_id"] == harness.node.node_id
    assert len(harness.coordinator.requests) == 1
    other = make_celery_app(harness.node.settings, harness.node.storage_settings)
    try:
        assert RUN_JOB_TASK not in other.tasks  # nothing process-wide carries the node along
    finally:
        other.close()
