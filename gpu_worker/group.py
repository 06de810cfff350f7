"""The only owner of rank processes: spawn, ready handshake, monitor, shutdown ladder.

One process per device from the `spawn` context. Rank 0 gets the command and result pipes; every
rank gets its own status pipe (ready / failed to start / fault) and the read end of a death pipe
whose write end only this process holds. A monitor thread sleeps in `connection.wait` on the
rank sentinels and the pipes; when any rank ends unasked, it kills the rest and reports once.
`shutdown()` is the ladder: ask rank 0 (which tells the others) -> grace -> SIGTERM -> SIGKILL;
`kill()` is SIGKILL at once, for a group that is hung or already broken.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from gpu_worker.config import GroupConfig
from gpu_worker.errors import RankStartupFailed, WorkerGroupDied
from gpu_worker.limits import DeclaredLimits
from gpu_worker.oom_kills import oom_kill_count
from gpu_worker.pipelines import prepare_pipeline
from gpu_worker.protocol import (
    CoordinatorCommand,
    FailureKind,
    LeaderMessage,
    RankFailed,
    RankFault,
    RankReady,
    ShutdownGroup,
)
from gpu_worker.rank import RankArgs, RankPipes, rank_main
from gpu_worker.settings import GpuWorkerSettings

logger = logging.getLogger(__name__)

TERMINATE_GRACE_S = 3.0
GroupMessage = LeaderMessage | RankFault
MessageHandler = Callable[[GroupMessage], None]
DeathHandler = Callable[[str], None]


def describe_exit(exitcode: int | None) -> str:
    """'exit code 3', 'killed by SIGKILL', or 'still running'."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class WorkerGroup:
    """A started set of rank processes; `start()` returns once every rank is ready."""

    def __init__(
        self,
        config: GroupConfig,
        on_message: MessageHandler | None = None,
        on_death: DeathHandler | None = None,
    ) -> None:
        self.config = config
        self._on_message = on_message or (lambda message: None)
        self._on_death = on_death or (lambda reason: None)
        self._processes: list[BaseProcess] = []
        self._status: list[Connection] = []
        self._conns: list[Connection] = []  # every parent-side end, closed at shutdown
        self._commands: Connection | None = None
        self._results: Connection | None = None
        self._store: dist.TCPStore | None = None
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._stopping = False
        self._dead_reason: str | None = None
        self.limits: dict[str, DeclaredLimits] = {}  # per pipeline, as rank 0 loaded it
        self._oom_kills_at_start: int | None = None
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.config.world())

    @property
    def pids(self) -> list[int]:
        """Rank pids in rank order (empty before `start`)."""
        return [process.pid for process in self._processes if process.pid is not None]

    @property
    def alive(self) -> bool:
        """Started, not stopped, and no rank has died."""
        return bool(self._processes) and not self._stopping and self._dead_reason is None

    def start(self) -> None:
        """Spawn every rank and wait until all are ready; raise `RankStartupFailed` otherwise.

        Call it from a thread that outlives the group: PR_SET_PDEATHSIG fires when the spawning
        *thread* exits (the coordinator spawns from its long-lived dispatcher thread).
        """
        atexit.register(self.shutdown)
        try:
            self._prepare_pipelines()
            self._spawn()
            self._await_ready()
        except BaseException:
            self.kill()
            raise
        self._oom_kills_at_start = oom_kill_count()
        self._monitor = threading.Thread(target=self._watch, name="kiln-group-monitor", daemon=True)
        self._monitor.start()

    def send(self, command: CoordinatorCommand) -> None:
        """Send a command to rank 0; raise `WorkerGroupDied` if the group is gone."""
        with self._send_lock:
            if not self.alive or self._commands is None:
                raise WorkerGroupDied(self._dead_reason or "the worker group is not running")
            try:
                self._commands.send(command)
            except OSError as exc:
                raise WorkerGroupDied(f"rank 0 is unreachable: {exc}") from exc

    def shutdown(self, grace_s: float | None = None) -> None:
        """Ask ranks to exit, then SIGTERM, then SIGKILL; idempotent, also runs at exit."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._stop(ask=True, grace_s=grace)

    def kill(self) -> None:
        """SIGKILL every rank now, no questions (a hung or broken group); idempotent."""
        self._stop(ask=False, grace_s=0.0)

    # --- spawning ------------------------------------------------------------------------------

    def _prepare_pipelines(self) -> None:
        # Here, outside any process group: a pipeline built inside one is saved whole only on
        # rank 0 (transformers), and ranks racing to build the same cache is wasted work.
        settings = self.config.settings or GpuWorkerSettings()
        for name, spec in self.config.pipelines.items():
            try:
                prepare_pipeline(spec, settings)
            except Exception as exc:
                raise RankStartupFailed(
                    f"pipeline {name} ({spec}) could not be prepared: {exc}"
                ) from exc

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        world = self.config.world()
        timeout = datetime.timedelta(seconds=self.config.ready_timeout_s)
        # The store lives here, bound to a free port by the kernel: no port race between ranks.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, len(world), is_master=True, wait_for_workers=False, timeout=timeout
        )
        death_r, self._death_w = ctx.Pipe(duplex=False)
        commands_r, self._commands = ctx.Pipe(duplex=False)
        self._results, results_w = ctx.Pipe(duplex=False)
        child_ends = [death_r, commands_r, results_w]
        for rank, device in enumerate(world):
            status_r, status_w = ctx.Pipe(duplex=False)
            pipes = RankPipes(status_w, death_r)
            if rank == 0:
                pipes.commands, pipes.results = commands_r, results_w
            process = ctx.Process(
                target=rank_main,
                args=(self._rank_args(rank, device), pipes),
                name=f"kiln-rank{rank}",
            )
            process.start()
            status_w.close()  # the child holds its own copy; ours would hide the child's EOF
            self._processes.append(process)
            self._status.append(status_r)
        for end in child_ends:
            end.close()
        self._conns = [self._commands, self._results, self._death_w, *self._status]

    def _rank_args(self, rank: int, device: str) -> RankArgs:
        config = self.config
        assert self._store is not None
        return RankArgs(
            rank=rank,
            world_size=self.world_size,
            device=device,
            backend=config.backend(),
            store_port=self._store.port,
            pipelines=dict(config.pipelines),
            parallel=config.parallel,
            node_name=config.node_name,
            threads=config.threads_per_rank(),
            parent_pid=os.getpid(),
            collective_timeout_s=config.collective_timeout_s,
            verdict_wait_s=config.verdict_wait_s,
            warmup=config.warmup,
            settings=config.settings,
        )

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        waiting = dict(enumerate(self._status))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankStartupFailed(
                    f"ranks {sorted(waiting)} not ready after {self.config.ready_timeout_s:.0f} s"
                )
            sentinels = {self._processes[rank].sentinel: rank for rank in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=remaining)
            woken = {r for r, conn in waiting.items() if conn in ready}
            woken |= {sentinels[s] for s in ready if isinstance(s, int) and s in sentinels}
            for rank in sorted(woken):
                self._check_ready(rank, waiting)

    def _check_ready(self, rank: int, waiting: dict[int, Connection]) -> None:
        conn = waiting[rank]
        message: object = None
        if conn.poll(0):
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = None
        if isinstance(message, RankReady):
            if rank == 0:
                self.limits = dict(message.limits)
            del waiting[rank]
        elif isinstance(message, RankFailed):
            raise RankStartupFailed(f"rank {rank} failed to start:\n{message.message}")
        elif message is None and conn.poll(0) is False and self._processes[rank].is_alive():
            return  # woken by nothing we can read yet
        else:
            self._processes[rank].join(timeout=1.0)  # EOF on the pipe: the rank is ending
            exit_text = describe_exit(self._processes[rank].exitcode)
            raise RankStartupFailed(f"rank {rank} ended before it was ready ({exit_text})")

    # --- monitoring ----------------------------------------------------------------------------

    def _watch(self) -> None:
        assert self._results is not None
        conns: list[Connection] = [self._results, *self._status]
        sentinels = {process.sentinel: rank for rank, process in enumerate(self._processes)}
        while True:
            ready = wait([self._wake_r, *conns, *sentinels])
            if self._wake_r in ready or self._stopping:
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
        process = self._processes[rank]
        process.join(timeout=5.0)  # the sentinel closes a moment before the exit status exists
        reason = f"rank {rank} (pid {process.pid}) {describe_exit(process.exitcode)}"
        oom_rank = self._oom_killed_rank()
        if oom_rank is not None:
            oom = f"rank {oom_rank} was killed by the kernel's out-of-memory killer (host memory)"
            reason += f"; {oom}"
            # Reported as that rank's own OOM: the request fails as OutOfMemory, not retryable,
            # instead of killing the rebuilt group again on each retry.
            self._handle(RankFault(oom_rank, None, FailureKind.OOM, oom, True))
        self._dead_reason = reason
        for other in self._processes:
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
            for rank, process in enumerate(self._processes)
            if not process.is_alive() and process.exitcode == -signal.SIGKILL
        ]
        if not killed or self._oom_kills_at_start is None:
            return None
        now = oom_kill_count()
        return killed[0] if now is not None and now > self._oom_kills_at_start else None

    # --- the shutdown ladder -------------------------------------------------------------------

    def _stop(self, *, ask: bool, grace_s: float) -> None:
        with self._state_lock:
            if self._stopping:
                return
            self._stopping = True
        alive = [p for p in self._processes if p.is_alive()]
        if ask and alive and self._commands is not None and self._dead_reason is None:
            with self._send_lock, contextlib.suppress(OSError):
                self._commands.send(ShutdownGroup())
            _wait_for_exit(alive, grace_s)
            for process in self._processes:
                if process.is_alive():
                    process.terminate()
            _wait_for_exit(self._processes, TERMINATE_GRACE_S)
        for process in self._processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        self._wake_w.send_bytes(b"x")
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(timeout=5.0)
        with self._send_lock:  # no send may be half-way through a pipe we close
            for conn in [*self._conns, self._wake_r, self._wake_w]:
                conn.close()
        self._store = None
        atexit.unregister(self.shutdown)


def _wait_for_exit(processes: list[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = [p for p in processes if p.is_alive()]
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wait([p.sentinel for p in pending], timeout=remaining)
        pending = [p for p in pending if p.is_alive()]
