"""The coordinator's idle timer (gpu_worker/sleep.py), on explicit clock readings."""

from __future__ import annotations

from kiln.gpu_worker.protocol import SleepGroup
from kiln.gpu_worker.sleep import IdleSleep


def test_an_idle_group_sleeps_once_after_the_threshold() -> None:
    idle = IdleSleep(10.0, "drop")
    assert idle.due(100.0, True, None) == (None, 110.0)  # timer starts at the first idle turn
    assert idle.due(105.0, True, 107.0) == (None, 107.0)  # the dispatcher's own time is earlier
    assert idle.due(109.9, True, None) == (None, 110.0)
    assert idle.due(110.0, True, None) == (SleepGroup("drop"), None)
    assert idle.asleep
    assert idle.due(500.0, True, None) == (None, None)  # asleep: sent once, nothing to wait for
    assert idle.sleeps == 1


def test_work_restarts_the_timer_and_a_dispatch_wakes_the_group() -> None:
    idle = IdleSleep(10.0, "offload")
    idle.due(0.0, True, None)
    assert idle.due(8.0, False, None) == (None, None)  # busy: the idle time so far is forgotten
    assert idle.due(9.0, True, None) == (None, 19.0)
    assert idle.due(19.0, True, None)[0] == SleepGroup("offload")
    assert idle.note_dispatch() is True
    assert idle.note_dispatch() is False  # awake already
    assert (idle.asleep, idle.wakes) == (False, 1)
    assert idle.due(30.0, True, None) == (None, 40.0)


def test_without_a_threshold_the_group_never_sleeps() -> None:
    idle = IdleSleep(None, "offload")
    assert idle.due(0.0, True, 5.0) == (None, 5.0)
    assert idle.due(1e9, True, None) == (None, None)
    assert idle.stats()["sleep_mode"] is None


def test_a_new_group_starts_awake() -> None:
    idle = IdleSleep(1.0, "drop")
    idle.due(0.0, True, None)
    idle.due(1.0, True, None)
    idle.note_new_group()
    assert not idle.asleep
    assert idle.due(2.0, True, None) == (None, 3.0)
