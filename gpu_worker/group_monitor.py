"""The watch over a started group: one thread delivers what the ranks report and notices deaths.

The thread sleeps in `connection.wait` on rank 0's result pipe, every rank's status pipe and the
rank sentinels. When a rank ends while nobody asked it to, the monitor kills the other ranks and
reports the death once, with the reason; a rank the kernel's OOM killer ended is reported as that
rank's own out-of-memory fault first.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from kiln.gpu_worker.group_spawn import RankProcesses, describe_exit
from kiln.gpu_worker.oom_kills import oom_kill_count
from kiln.gpu_worker.protocol import (
    FailureKind,
    LeaderMessage,
    RankFailed,
    RankFault,
    RankReady,
)

logger = logging.getLogger(__name__)

GroupMessage = LeaderMessage | RankFault
MessageHandler = Callable[[GroupMessage], None]
DeathHandler = Callable[[str], None]


class GroupMonitor:
    """Delivers a started group's messages and its death; `dead_reason` once a rank died."""

    def __init__(
        self, ranks: RankProcesses, on_message: MessageHandler, on_death: DeathHandler
    ) -> None:
        self._ranks = ranks
        self._on_message = on_message
        self._on_death = on_death
        self.dead_reason: str | None = None
        self._exits_expected = False
        self._oom_kills_at_start: int | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)

    def start(self) -> None:
        """Start watching; call once every rank is ready."""
        self._oom_kills_at_start = oom_kill_count()
        self._thread = threading.Thread(target=self._watch, name="kiln-group-monitor", daemon=True)
        self._thread.start()

    def expect_exits(self) -> None:
        """The owner is stopping the ranks: from now on their exits are not deaths."""
        self._exits_expected = True

    def close(self) -> None:
        """Stop the thread (unless called on it) and close the wake-up pipe."""
        self._wake_w.send_bytes(b"x")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        self._wake_r.close()
        self._wake_w.close()

    def _watch(self) -> None:
        assert self._ranks.results is not None
        conns: list[Connection] = [self._ranks.results, *self._ranks.status]
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._ranks.processes)}
        while True:
            ready = wait([self._wake_r, *conns, *sentinels])
            if self._wake_r in ready or self._exits_expected:
                return
            for conn in [c for c in conns if c in ready]:
                self._deliver(conn, conns)
            ended = [sentinels[s] for s in ready if isinstance(s, int) and s in sentinels]
            if ended:
                self._declare_dead(ended[0], conns)
                return

    def _deliver(self, conn: Connection, conns: list[Connection]) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            conns.remove(conn)  # its rank is ending; the sentinel says so next
            return
        if isinstance(message, (RankReady, RankFailed)):
            return
        self._handle(message)

    def _handle(self, message: GroupMessage) -> None:
        try:
            self._on_message(message)
        except Exception:  # a bad handler must not blind the monitor
            logger.exception("worker group message handler failed on %r", type(message).__name__)

    def _declare_dead(self, rank: int, conns: list[Connection]) -> None:
        # Messages sent before the death still count (a fault notice, a finished batch).
        for conn in list(conns):
            while conn in conns and conn.poll(0):
                self._deliver(conn, conns)
        process = self._ranks.processes[rank]
        process.join(timeout=5.0)  # the sentinel closes a moment before the exit status exists
        reason = f"rank {rank} (pid {process.pid}) {describe_exit(process.exitcode)}"
        oom_rank = self._oom_killed_rank()
        if oom_rank is not None:
            oom = f"rank {oom_rank} was killed by the kernel's out-of-memory killer (host memory)"
            reason += f"; {oom}"
            # Reported as that rank's own OOM: the request fails as OutOfMemory, not retryable,
            # instead of killing the rebuilt group again on each retry.
            self._handle(RankFault(oom_rank, None, FailureKind.OOM, oom, True))
        self.dead_reason = reason
        for other in self._ranks.processes:
            if other.is_alive():
                other.kill()
            other.join(timeout=5.0)
        logger.warning("worker group died: %s", reason)
        try:
            self._on_death(reason)
        except Exception:
            logger.exception("worker group death handler failed")

    def _oom_killed_rank(self) -> int | None:
        # A SIGKILL could come from anyone; the cgroup's OOM-kill count going up while this group
        # lived says the kernel sent it. Looked at before we SIGKILL the other ranks ourselves.
        killed = [
            rank
            for rank, process in enumerate(self._ranks.processes)
            if not process.is_alive() and process.exitcode == -signal.SIGKILL
        ]
        if not killed or self._oom_kills_at_start is None:
            return None
        now = oom_kill_count()
        return killed[0] if now is not None and now > self._oom_kills_at_start else None
