"""When an idle worker group goes to sleep, and how it wakes: the coordinator's side.

After `KILN_IDLE_SLEEP_S` with nothing queued or running, the dispatcher sends `SleepGroup` to
rank 0, which relays it so every rank releases its pipelines' memory together
(gpu_worker/ranks/sleep.py). There is no wake message: the next `RunBatch` wakes every rank before
it runs, and rank 0 reports the time that took as the batch's `RunMetrics.wake_s`. The dispatcher
is the only sender of both commands, so a batch that arrives while the group falls asleep is
queued behind the sleep on rank 0's pipe and wakes it: nothing is lost or run twice.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kiln.gpu_worker.protocol import GroupAsleep, SleepGroup


class IdleSleep:
    """The idle timer and sleep state of one group; kept under the coordinator's lock."""

    def __init__(self, idle_sleep_s: float | None, mode: str) -> None:
        self.idle_sleep_s = idle_sleep_s
        self.mode = mode
        self.asleep = False
        self.sleeps = 0
        self.wakes = 0
        self.last_sleep: GroupAsleep | None = None  # rank 0's report of the latest sleep
        self._idle_since: float | None = None

    def due(
        self, now: float, idle: bool, look_at: float | None
    ) -> tuple[SleepGroup | None, float | None]:
        """On a dispatcher turn: the sleep command due now, and when to look again.

        The time is the dispatcher's own `look_at` (None: none), or the idle timer's if earlier.
        """
        if self.idle_sleep_s is None or not idle:
            self._idle_since = None
            return None, look_at
        if self.asleep:
            return None, look_at
        if self._idle_since is None:
            self._idle_since = now
        sleep_at = self._idle_since + self.idle_sleep_s
        if now < sleep_at:
            return None, sleep_at if look_at is None else min(look_at, sleep_at)
        self.asleep = True
        self.sleeps += 1
        return SleepGroup(self.mode), look_at

    def note_dispatch(self) -> bool:
        """A batch goes to the group, which wakes for it; True when it was asleep."""
        self._idle_since = None
        woke, self.asleep = self.asleep, False
        self.wakes += int(woke)
        return woke

    def note_new_group(self) -> None:
        """A new group starts awake (a rebuild after a death replaces a sleeping one)."""
        self.asleep = False
        self._idle_since = None

    def on_report(self, report: GroupAsleep) -> None:
        """Rank 0 says every rank is asleep, with its memory before and after."""
        self.last_sleep = report

    def stats(self) -> dict[str, Any]:
        """For the heartbeat: asleep or not, the counts, the latest sleep's memory report."""
        return {
            "asleep": self.asleep,
            "sleep_mode": self.mode if self.idle_sleep_s is not None else None,
            "sleeps": self.sleeps,
            "wakes": self.wakes,
            "last_sleep": asdict(self.last_sleep) if self.last_sleep is not None else None,
        }


def node_asleep(stats: dict[str, Any]) -> bool:
    """A node's coordinator stats say asleep: its group, or every one of its replica groups."""
    groups = stats.get("groups")
    if isinstance(groups, list) and groups:
        return all(bool(group.get("asleep")) for group in groups)
    return bool(stats.get("asleep"))


def node_warming(stats: dict[str, Any]) -> bool:
    """Any group of the node is starting, loading or warming up (no job runs on it meanwhile)."""
    groups = stats.get("groups")
    if isinstance(groups, list) and groups:
        return any(bool(group.get("warming")) for group in groups)
    return bool(stats.get("warming"))
