"""Operator controls on a node: pauses, drains, held-back deliveries, the running cap per key.

Real Redis, a fake worker group, and a consumer switch that records what the node asked for.
"""

from __future__ import annotations

import uuid

from kiln.common.request import Lane
from kiln.common.states import JobState
from kiln.storage.job_store import NewJob
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.controls import NodeControls
from tests.tasks.node.conftest import PIPELINE, QUEUE, STEPS, NodeFactory, NodeHarness

BULK = f"bulk.{PIPELINE}"
QUEUES = [QUEUE, BULK]


class FakeSwitch:
    """Records what the node asked its worker; agrees to everything unless told not to."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.agree = True

    def cancel(self, queue: str) -> bool:
        self.calls.append(("cancel", queue))
        return self.agree

    def add(self, queue: str) -> bool:
        self.calls.append(("add", queue))
        return self.agree

    def is_ready(self) -> bool:
        return True


def owned_job(harness: NodeHarness, owner: str, queue: str = QUEUE) -> str:
    """A queued job of `owner` in `queue`, as the API creates it."""
    lane = queue.partition(".")[0]
    request = JobRequest(
        pipeline=PIPELINE, prompt="a kiln", width=64, height=64, steps=STEPS, seed=7,
        priority=Lane(lane),
    )  # fmt: skip
    job_id = uuid.uuid4().hex
    harness.store.create_job(
        NewJob(id=job_id, request=request.to_record(), owner=owner, lane=lane, queue=queue)
    )
    return job_id


def controls_for(harness: NodeHarness) -> tuple[NodeControls, FakeSwitch, list[str]]:
    switch, exits = FakeSwitch(), []
    controls = NodeControls(harness.node, QUEUES, switch, on_exit=lambda: exits.append("exit"))
    return controls, switch, exits


def test_a_node_starts_without_paused_queues(harness: NodeHarness) -> None:
    harness.store.pause_queue(BULK)
    controls, switch, _ = controls_for(harness)
    assert controls.start_queues() == [QUEUE]
    assert controls.held_at_start == [BULK]
    assert switch.calls == []
    assert harness.node.health()["consuming"] == [QUEUE]
    assert harness.node.health()["paused_queues"] == [BULK]


def test_pause_and_resume_switch_the_consumer(harness: NodeHarness) -> None:
    controls, switch, _ = controls_for(harness)
    controls.start_queues()
    harness.store.pause_queue(QUEUE)
    controls.poll()
    assert switch.calls == [("cancel", QUEUE)]
    assert list(harness.node.controls.consuming) == [BULK]
    controls.poll()  # nothing changed: nothing sent
    assert switch.calls == [("cancel", QUEUE)]
    harness.store.resume_queue(QUEUE)
    controls.poll()
    assert switch.calls == [("cancel", QUEUE), ("add", QUEUE)]
    assert list(harness.node.controls.consuming) == [QUEUE, BULK]


def test_a_command_without_an_answer_is_sent_again(harness: NodeHarness) -> None:
    controls, switch, _ = controls_for(harness)
    controls.start_queues()
    harness.store.pause_queue(BULK)
    switch.agree = False
    controls.poll()
    assert list(harness.node.controls.consuming) == [QUEUE, BULK]  # not confirmed
    switch.agree = True
    controls.poll()
    assert switch.calls == [("cancel", BULK), ("cancel", BULK)]
    assert list(harness.node.controls.consuming) == [QUEUE]


def test_a_delivery_from_a_paused_queue_is_published_again_untouched(
    harness: NodeHarness,
) -> None:
    job_id = owned_job(harness, "key_a", BULK)
    harness.store.pause_queue(BULK)
    controls, _, _ = controls_for(harness)
    controls.poll()
    harness.deliver(job_id)
    record = harness.store.get(job_id)
    assert (record.state, record.attempts) == (JobState.QUEUED, 0)
    assert harness.event_types(job_id) == ["queued"]
    assert harness.published == [(job_id, BULK, harness.node.settings.lease_busy_delay_s)]
    assert harness.coordinator.requests == []


def test_drain_finishes_the_running_job_takes_nothing_new_then_exits(
    harness: NodeHarness,
) -> None:
    controls, switch, exits = controls_for(harness)
    controls.start_queues()
    running, waiting = harness.submit(), harness.submit()

    def drain_mid_run(step: int) -> None:
        if step != 2:
            return
        harness.store.request_drain(harness.node.node_id, exit=True)
        controls.poll()  # the drain lands while the job runs
        assert harness.node.draining.is_set()
        assert exits == []  # a job is still running
        harness.deliver(waiting)  # a delivery during the drain: not started here

    harness.coordinator.on_step = drain_mid_run
    harness.deliver(running)
    assert harness.store.get(running).state == JobState.SUCCEEDED  # finished, not handed back
    assert harness.store.get(waiting).state == JobState.QUEUED
    assert harness.event_types(waiting) == ["queued"]
    assert harness.published == [(waiting, QUEUE, harness.node.settings.lease_busy_delay_s)]
    assert sorted(switch.calls) == [("cancel", BULK), ("cancel", QUEUE)]
    health = harness.node.health()
    assert health["draining"] is True
    assert health["consuming"] == []
    drain = health["drain"]
    assert isinstance(drain, dict)
    assert drain["exit"] is True
    controls.poll()  # idle now: exit, and the request is withdrawn
    assert exits == ["exit"]
    assert harness.store.drain_requests() == {}
    controls.poll()
    assert exits == ["exit"]  # once
    assert harness.node.draining.is_set()  # still draining while it exits


def test_a_drain_without_exit_stays_idle_until_withdrawn(harness: NodeHarness) -> None:
    controls, switch, exits = controls_for(harness)
    controls.start_queues()
    harness.store.request_drain(harness.node.node_id, exit=False)
    controls.poll()
    controls.poll()
    assert exits == []
    assert harness.node.health()["draining"] is True
    harness.store.withdraw_drain(harness.node.node_id)
    controls.poll()
    assert not harness.node.draining.is_set()
    assert list(harness.node.controls.consuming) == [QUEUE, BULK]
    assert switch.calls[-2:] == [("add", QUEUE), ("add", BULK)]


def test_a_sigterm_drain_is_not_undone_by_the_operator(harness: NodeHarness) -> None:
    controls, _, _ = controls_for(harness)
    controls.start_queues()
    harness.store.request_drain(harness.node.node_id, exit=False)
    controls.poll()
    harness.node.controls.shutting_down = True  # what SIGTERM sets
    harness.store.withdraw_drain(harness.node.node_id)
    controls.poll()
    assert harness.node.draining.is_set()
    assert list(harness.node.controls.consuming) == []


def test_a_shutting_down_node_sends_its_worker_no_commands(harness: NodeHarness) -> None:
    """SIGTERM: Celery's warm shutdown stops consuming and answers no remote control.

    A cancel sent then would only wait out its reply timeout, per queue, holding the exit back.
    """
    controls, switch, exits = controls_for(harness)
    controls.start_queues()
    harness.node.controls.shutting_down = True  # what SIGTERM sets, with the drain
    harness.node.draining.set()
    harness.store.request_drain(harness.node.node_id, exit=True)  # and an operator's drain-exit
    controls.poll()
    assert switch.calls == []
    assert list(harness.node.controls.consuming) == []
    assert exits == []  # a second SIGTERM would cut the warm shutdown short


def test_the_running_cap_defers_a_start(make_node: NodeFactory) -> None:
    harness = make_node(max_running_per_key=1)
    first, second, other = (owned_job(harness, o) for o in ("key_a", "key_a", "key_b"))
    token = harness.store.acquire_lease(first, "other-node/1")
    harness.store.start(first, token, node_id="other-node")  # key_a runs one elsewhere
    harness.deliver(second)
    record = harness.store.get(second)
    # held, then refused at its start (the cap applies as the group takes it): still queued,
    # no attempt spent, waiting in no node
    assert (record.state, record.attempts, record.progress) == (JobState.QUEUED, 0, None)
    assert harness.event_types(second) == ["queued", "progress"]
    assert harness.coordinator.requests == []  # the group never ran it
    assert harness.store.lease_owner(second) is None  # released
    assert harness.published == [(second, QUEUE, harness.node.settings.lease_busy_delay_s)]
    harness.deliver(other)  # another key is not held up
    assert harness.store.get(other).state == JobState.SUCCEEDED
    harness.store.succeed(first, token, [], {})
    harness.deliver(second)  # room again
    assert harness.store.get(second).state == JobState.SUCCEEDED
