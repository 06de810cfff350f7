"""The only owner of rank processes: `WorkerGroup` starts them, sends rank 0 commands, stops them.

`start()` builds what the pipelines load from, spawns the ranks and waits for each one's ready
handshake (`gpu_worker.group_spawn`), then a monitor thread watches them
(`gpu_worker.group_monitor`): when any rank ends unasked, it kills the rest and reports once.
`shutdown()` is the ladder: ask rank 0 (which tells the others) -> grace -> SIGTERM -> SIGKILL;
`kill()` is SIGKILL at once, for a group that is hung or already broken.
"""

from __future__ import annotations

import atexit
import contextlib
import threading

from kiln.common.limits import DeclaredLimits
from kiln.common.request import InputSchema
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.errors import WorkerGroupDied
from kiln.gpu_worker.group_monitor import DeathHandler, GroupMessage, GroupMonitor, MessageHandler
from kiln.gpu_worker.group_spawn import RankProcesses, wait_for_exit
from kiln.gpu_worker.protocol import CoordinatorCommand, ShutdownGroup

__all__ = ["DeathHandler", "GroupMessage", "MessageHandler", "WorkerGroup"]

TERMINATE_GRACE_S = 3.0


class WorkerGroup:
    """A started set of rank processes; `start()` returns once every rank is ready."""

    def __init__(
        self,
        config: GroupConfig,
        on_message: MessageHandler | None = None,
        on_death: DeathHandler | None = None,
    ) -> None:
        self.config = config
        self._ranks = RankProcesses(config)
        self._monitor = GroupMonitor(
            self._ranks, on_message or (lambda _message: None), on_death or (lambda _reason: None)
        )
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._stopping = False

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.config.world())

    @property
    def pids(self) -> list[int]:
        """Rank pids in rank order (empty before `start`)."""
        return [process.pid for process in self._ranks.processes if process.pid is not None]

    @property
    def alive(self) -> bool:
        """Started, not stopped, and no rank has died."""
        return bool(self._ranks.processes) and not self._stopping and self._dead_reason is None

    @property
    def limits(self) -> dict[str, DeclaredLimits]:
        """What each pipeline declares it takes, as rank 0 loaded it (empty before `start`)."""
        return self._ranks.limits

    @property
    def input_schemas(self) -> dict[str, InputSchema]:
        """Input schemas of the pipelines that declare one, as rank 0 loaded them."""
        return self._ranks.input_schemas

    @property
    def _dead_reason(self) -> str | None:
        return self._monitor.dead_reason

    def start(self) -> None:
        """Spawn every rank and wait until all are ready; raise `RankStartupFailed` otherwise.

        Call it from a thread that outlives the group: PR_SET_PDEATHSIG fires when the spawning
        *thread* exits (the coordinator spawns from its long-lived dispatcher thread).
        """
        atexit.register(self.shutdown)
        try:
            self._ranks.prepare_pipelines()
            self._ranks.spawn()
            self._ranks.await_ready()
        except BaseException:
            self.kill()
            raise
        self._monitor.start()

    def send(self, command: CoordinatorCommand) -> None:
        """Send a command to rank 0; raise `WorkerGroupDied` if the group is gone."""
        with self._send_lock:
            commands = self._ranks.commands
            if not self.alive or commands is None:
                raise WorkerGroupDied(self._dead_reason or "the worker group is not running")
            try:
                commands.send(command)
            except OSError as exc:
                raise WorkerGroupDied(f"rank 0 is unreachable: {exc}") from exc

    def shutdown(self, grace_s: float | None = None) -> None:
        """Ask ranks to exit, then SIGTERM, then SIGKILL; idempotent, also runs at exit."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._stop(ask=True, grace_s=grace)

    def kill(self) -> None:
        """SIGKILL every rank now, no questions (a hung or broken group); idempotent."""
        self._stop(ask=False, grace_s=0.0)

    # --- the shutdown ladder ---------------------------------------------------------------------

    def _stop(self, *, ask: bool, grace_s: float) -> None:
        with self._state_lock:
            if self._stopping:
                return
            self._stopping = True
            self._monitor.expect_exits()
        processes = self._ranks.processes
        alive = [p for p in processes if p.is_alive()]
        commands = self._ranks.commands
        if ask and alive and commands is not None and self._dead_reason is None:
            with self._send_lock, contextlib.suppress(OSError):
                commands.send(ShutdownGroup())
            wait_for_exit(alive, grace_s)
            for process in processes:
                if process.is_alive():
                    process.terminate()
            wait_for_exit(processes, TERMINATE_GRACE_S)
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        self._monitor.close()
        with self._send_lock:  # no send may be half-way through a pipe we close
            self._ranks.close()
        atexit.unregister(self.shutdown)
