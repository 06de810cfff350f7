"""Declared loops: each runs on its own thread, outlives a failing step, rests while paused."""

from __future__ import annotations

import threading

import pytest

from kiln.storage.errors import StorageError
from kiln.tasks.control.components import Component, Loops
from kiln.tasks.control.room import cluster_components, served_queues
from tests.tasks.control.conftest import ControlFactory
from tests.waiting import wait_until


def test_a_step_that_raises_is_tried_again_and_stop_joins_every_thread() -> None:
    calls = {"storage": 0, "bug": 0, "fine": 0}

    def storage_down() -> None:
        calls["storage"] += 1
        raise StorageError("redis is away")

    def bug() -> None:
        calls["bug"] += 1
        raise RuntimeError("a bad iteration")

    loops = Loops(
        [
            Component("storage", 0.001, storage_down),
            Component("bug", 0.001, bug),
            Component("fine", 0.001, lambda: calls.__setitem__("fine", calls["fine"] + 1)),
        ]
    )
    loops.start()
    wait_until(lambda: dict(calls), lambda seen: min(seen.values()) >= 3, what="three rounds each")
    loops.stop()
    # stopped: no component's thread is left to run a step (the failing ones' and the fine one's)
    names = {"kiln-storage", "kiln-bug", "kiln-fine"}
    assert not [t for t in threading.enumerate() if t.name in names]
    assert loops.names == ["storage", "bug", "fine"]


def test_a_paused_component_skips_its_step() -> None:
    paused = threading.Event()
    paused.set()
    ran: list[int] = []
    component = Component("feeder", 1.0, lambda: ran.append(1), paused.is_set)
    component.run_once()
    assert ran == []
    paused.clear()
    component.run_once()
    assert ran == [1]


def test_the_cluster_components_are_declared_with_their_intervals(
    make_control: ControlFactory,
) -> None:
    ctx = make_control(reaper_interval_s=3.0, batch_feed_interval_s=0.5).ctx
    declared = {c.name: c.interval_s for c in cluster_components(ctx, lambda: [])}
    assert declared == {
        "reaper": 3.0,
        "sweeper": 3.0,
        "pruner": 60.0,
        "paused": 60.0,
        "preemption": 3.0,  # as often as the reaper: a late interactive job waits no longer
        "restarts": 3.0,
        "audit": min(ctx.settings.heartbeat_interval_s, ctx.settings.queued_audit_interval_s),
        "batches": 0.5,
    }


def test_control_audits_every_lane_of_every_pipeline_configured_or_announced(
    make_control: ControlFactory,
) -> None:
    ctx = make_control(pipelines=["tiny"]).ctx
    ctx.store.publish_node("node-a", {"pipelines": ["sdxl"]}, 30.0)
    assert sorted(served_queues(ctx)) == [
        "bulk.sdxl",
        "bulk.tiny",
        "interactive.sdxl",
        "interactive.tiny",
    ]


def test_each_start_runs_before_its_loop_and_each_stop_after_it_ended() -> None:
    seen: list[str] = []
    steps = threading.Event()

    def step() -> None:
        seen.append("step")
        steps.set()

    loops = Loops(
        [
            Component("first", 1.0, lambda: None, start=lambda: seen.append("start first")),
            Component(
                "second",
                0.001,
                step,
                start=lambda: seen.append("start second"),
                stop=lambda: seen.append("stop second"),
            ),
        ]
    )
    loops.start()
    assert seen[:2] == ["start first", "start second"]
    wait_until(steps.is_set, what="a step")
    loops.stop()
    assert seen[-1] == "stop second"
    assert "step" not in seen[seen.index("stop second") :]


def test_a_failing_start_stops_the_start_there() -> None:
    def refuse() -> None:
        raise StorageError("redis is away")

    loops = Loops(
        [
            Component("heartbeat", 1.0, lambda: None, start=refuse),
            Component("reaper", 1.0, lambda: None),
        ]
    )
    with pytest.raises(StorageError):
        loops.start()
    assert not [t for t in threading.enumerate() if t.name in {"kiln-heartbeat", "kiln-reaper"}]
    loops.stop()  # nothing started: nothing to join or stop
