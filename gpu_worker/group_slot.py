"""The worker group a coordinator currently runs on, and why it must be replaced.

Only the coordinator's dispatcher thread builds, kills and replaces groups: a rank's
PR_SET_PDEATHSIG is tied to the thread that spawned it. Each group gets a generation number, so
what an older group still reports (a message, its death) is recognised as stale.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kiln.common.limits import DeclaredLimits
from kiln.common.request import InputSchema
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.errors import RankStartupFailed
from kiln.gpu_worker.group import GroupMessage, WorkerGroup

# Handlers of the current group's messages and death; they get the group's generation.
GenerationMessageHandler = Callable[[int, GroupMessage], None]
GenerationDeathHandler = Callable[[int, str], None]


class GroupSlot:
    """The current group and its generation, replacement reasons and limits.

    Guarded by the coordinator's lock (`cond`); `build` takes it itself around its state changes.
    """

    def __init__(self, config: GroupConfig, cond: threading.Condition) -> None:
        self._config = config
        self._cond = cond
        self.group: WorkerGroup | None = None
        self.generation = 0
        self.kill_reason: str | None = None  # the coordinator gave up on the group
        self.dead_reason: str | None = None  # the group died, or rank 0 became unreachable
        self.rebuilds = 0
        self.limits: dict[str, DeclaredLimits] = {}  # per pipeline, as the last group loaded it
        self.input_schemas: dict[str, InputSchema] = {}  # likewise, for pipelines that declare

    def build(self, on_message: GenerationMessageHandler, on_death: GenerationDeathHandler) -> None:
        """Start a new group of the next generation; raise `RankStartupFailed`."""
        with self._cond:
            self.generation += 1
            generation = self.generation
        group = WorkerGroup(
            self._config,
            on_message=lambda message: on_message(generation, message),
            on_death=lambda reason: on_death(generation, reason),
        )
        try:
            group.start()
        except RankStartupFailed:
            raise
        except Exception as exc:
            raise RankStartupFailed(f"starting the worker group failed: {exc}") from exc
        with self._cond:
            self.group = group
            self.limits = dict(group.limits)
            self.input_schemas = dict(group.input_schemas)

    def is_current(self, generation: int) -> bool:
        """True when `generation` is the group in the slot (or the one being built)."""
        return generation == self.generation

    def must_replace(self) -> bool:
        """The group was killed by the coordinator's decision or died."""
        return self.kill_reason is not None or self.dead_reason is not None

    def detach(self) -> tuple[WorkerGroup | None, str]:
        """Empty the slot: the old group (for the caller to stop) and why it goes."""
        old, self.group = self.group, None
        reason = self.kill_reason or self.dead_reason or "the worker group stopped"
        self.kill_reason = self.dead_reason = None
        return old, reason

    def note_unreachable(self, group: WorkerGroup, reason: str) -> bool:
        """Rank 0 of `group` could not be reached; True when that is news about the current one."""
        if group is not self.group or self.dead_reason is not None:
            return False
        self.dead_reason = reason
        return True
