"""Priority preemption's decision (tasks/control/preemption.py) on real Redis.

Nodes are heartbeats as a node publishes them; running jobs are records started through the
store under a lease owned by `<node>/<delivery>`, as a node's delivery holds them. A late job is a
queued interactive job created longer ago than the lane's target start (its record backdated).
"""

from __future__ import annotations

from typing import Any

import pytest

from kiln.common.stops import StopReason
from kiln.storage.job_store import JobStore
from kiln.tasks.control.preemption import Preemption, preempt_for_late_jobs
from tests.storage.helpers import new_job
from tests.tasks.control.conftest import PIPELINE, ControlFactory, ControlHarness

INTERACTIVE, BULK = f"interactive.{PIPELINE}", f"bulk.{PIPELINE}"
QUEUES = [INTERACTIVE, BULK]
# the guard's least run is 0 unless a test says otherwise: the runs here last milliseconds
FAST = {"target_start_s_interactive": 30.0, "priority_preemption_min_run_s": 0.0}


def _late(store: JobStore, *, lane: str = "interactive", held_by: str | None = None) -> str:
    """A queued job created long before its lane's target start (optionally held by a node)."""
    queue = f"{lane}.{PIPELINE}"
    record, _ = store.create_job(new_job(lane=lane, queue=queue))
    store.redis.hset(store.keys.job(record.id), "created_at", store.redis_now() - 3600)
    if held_by is not None:
        store.hold(record.id, f"{held_by}/delivery-{record.id}", held_by, 0)
    return record.id


def _running(store: JobStore, node: str, *, lane: str = "bulk") -> str:
    record, _ = store.create_job(new_job(lane=lane, queue=f"{lane}.{PIPELINE}"))
    token = store.acquire_lease(record.id, f"{node}/delivery-{record.id}")
    store.start(record.id, token)
    return record.id


def _node(
    store: JobStore, node: str, checkpointing: list[str], waiting: int = 0, *, current: bool = True
) -> None:
    """A node's heartbeat; `current=False`: one of the release before preemptions were stops."""
    info: dict[str, Any] = {
        "pipelines": [PIPELINE],
        "jobs_waiting": waiting,
        "checkpointing_jobs": checkpointing,
        "draining": False,
    }
    if current:
        info["stops_read"] = ["canceled", "paused", "preempted"]  # as Node.health lists them
    store.publish_node(node, info, 60.0)


def _requested(store: JobStore, *job_ids: str) -> dict[str, str | None]:
    """The preemptions asked of these jobs (their stop requests), and the job each is for."""
    return {
        job_id: request.for_job
        for job_id, request in store.stops_requested(list(job_ids)).items()
        if request.reason == StopReason.PREEMPTED
    }


@pytest.fixture
def control(make_control: ControlFactory) -> ControlHarness:
    return make_control(**FAST)


def test_a_late_interactive_job_preempts_a_bulk_job_on_a_node_with_no_other_waiting_job(
    control: ControlHarness, job_store: JobStore
) -> None:
    busy_a, busy_b = _running(job_store, "node-a"), _running(job_store, "node-b")
    _node(job_store, "node-a", [busy_a], waiting=1)  # its group's next job is taken already
    _node(job_store, "node-b", [busy_b])
    late = _late(job_store)

    asked = preempt_for_late_jobs(control.ctx, QUEUES)

    assert asked == [Preemption(busy_b, "node-b", late)]
    assert _requested(job_store, busy_a, busy_b) == {busy_b: late}
    assert preempt_for_late_jobs(control.ctx, QUEUES) == []  # one preemption per late job


def test_a_late_job_held_by_a_node_preempts_that_nodes_bulk_job(
    control: ControlHarness, job_store: JobStore
) -> None:
    busy_a, busy_b = _running(job_store, "node-a"), _running(job_store, "node-b")
    _node(job_store, "node-a", [busy_a], waiting=1)
    _node(job_store, "node-b", [busy_b])
    late = _late(job_store, held_by="node-a")
    assert preempt_for_late_jobs(control.ctx, QUEUES) == [Preemption(busy_a, "node-a", late)]


def test_each_late_job_gets_a_bulk_job_of_its_own(
    control: ControlHarness, job_store: JobStore
) -> None:
    busy_a, busy_b = _running(job_store, "node-a"), _running(job_store, "node-b")
    _node(job_store, "node-a", [busy_a])
    _node(job_store, "node-b", [busy_b])
    first, second = _late(job_store), _late(job_store)
    asked = preempt_for_late_jobs(control.ctx, QUEUES)
    assert sorted(p.for_job for p in asked) == sorted([first, second])
    assert {p.job_id for p in asked} == {busy_a, busy_b}


def test_nothing_is_preempted_while_a_node_serving_the_pipeline_is_idle(
    control: ControlHarness, job_store: JobStore
) -> None:
    busy = _running(job_store, "node-a")
    _node(job_store, "node-a", [busy])
    _node(job_store, "node-idle", [])
    _late(job_store)
    assert preempt_for_late_jobs(control.ctx, QUEUES) == []
    assert _requested(job_store, busy) == {}


def test_a_node_that_takes_no_work_is_not_an_idle_one(
    control: ControlHarness, job_store: JobStore
) -> None:
    busy = _running(job_store, "node-a")
    _node(job_store, "node-a", [busy])
    job_store.publish_node(
        "node-quarantined",
        {"pipelines": [PIPELINE], "quarantined": {"reason": "device", "since": 1.0}},
        60.0,
    )
    late = _late(job_store)
    assert preempt_for_late_jobs(control.ctx, QUEUES) == [Preemption(busy, "node-a", late)]


def test_nothing_is_preempted_while_a_node_runs_interactive_work(
    control: ControlHarness, job_store: JobStore
) -> None:
    busy = _running(job_store, "node-a")
    interactive = _running(job_store, "node-b", lane="interactive")
    _node(job_store, "node-a", [busy])
    _node(job_store, "node-b", [interactive])
    _late(job_store)
    assert preempt_for_late_jobs(control.ctx, QUEUES) == []


def test_a_late_bulk_job_preempts_nothing(control: ControlHarness, job_store: JobStore) -> None:
    busy = _running(job_store, "node-a")
    _node(job_store, "node-a", [busy])
    _late(job_store, lane="bulk")
    assert preempt_for_late_jobs(control.ctx, QUEUES) == []


def test_a_job_within_its_target_start_preempts_nothing(
    make_control: ControlFactory, job_store: JobStore
) -> None:
    control = make_control(**{**FAST, "target_start_s_interactive": 7200.0})
    busy = _running(job_store, "node-a")
    _node(job_store, "node-a", [busy])
    _late(job_store)  # an hour ago: within two hours
    assert preempt_for_late_jobs(control.ctx, QUEUES) == []


def test_only_a_job_whose_run_takes_checkpoints_is_preempted(
    control: ControlHarness, job_store: JobStore
) -> None:
    _running(job_store, "node-a")
    _node(job_store, "node-a", [])  # its run takes none: stopping it would lose its steps
    _late(job_store)
    assert preempt_for_late_jobs(control.ctx, QUEUES) == []


def test_the_guard_caps_preemptions_per_job_and_keeps_a_least_run(
    make_control: ControlFactory, job_store: JobStore
) -> None:
    busy = _running(job_store, "node-a")
    _node(job_store, "node-a", [busy])
    _late(job_store)
    long_run = make_control(**{**FAST, "priority_preemption_min_run_s": 3600.0})
    assert preempt_for_late_jobs(long_run.ctx, QUEUES) == []  # it started just now
    job_store.redis.hset(job_store.keys.job(busy), "preemptions", 2)
    capped = make_control(**{**FAST, "priority_preemption_max": 2})
    assert preempt_for_late_jobs(capped.ctx, QUEUES) == []  # preempted twice already
    assert (
        len(preempt_for_late_jobs(make_control(**FAST, priority_preemption_max=3).ctx, QUEUES)) == 1
    )


def test_a_node_of_the_release_before_is_asked_for_no_preemption(
    control: ControlHarness, job_store: JobStore
) -> None:
    # it reads every stop request but a pause as a cancel: a preemption would cancel its job
    old, current = _running(job_store, "node-old"), _running(job_store, "node-new")
    _node(job_store, "node-old", [old], current=False)
    _node(job_store, "node-new", [current], waiting=1)  # the other is the better place
    late = _late(job_store)
    assert preempt_for_late_jobs(control.ctx, QUEUES) == [Preemption(current, "node-new", late)]
    assert _requested(job_store, old, current) == {current: late}
    assert job_store.stops_requested([old]) == {}


def test_the_setting_switches_it_off(make_control: ControlFactory, job_store: JobStore) -> None:
    busy = _running(job_store, "node-a")
    _node(job_store, "node-a", [busy])
    _late(job_store)
    off = make_control(**{**FAST, "priority_preemption": False})
    assert preempt_for_late_jobs(off.ctx, QUEUES) == []
    assert _requested(job_store, busy) == {}
