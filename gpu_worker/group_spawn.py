"""A group's rank processes as their owner holds them: spawned, handshaken, and how each ended.

One process per device, forked by the rank server (`gpu_worker.rank_server`, the default) or
spawned (`KILN_RANK_START=spawn`). Rank 0 gets the command and result pipes; every
rank gets its own status pipe (ready / failed to start / fault) and the read end of a death pipe
whose write end only the owner holds. Before any rank starts, what the pipelines load from is
made ready on disk here, outside any process group.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from kiln.common.limits import DeclaredLimits
from kiln.common.request import InputSchema
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.errors import RankStartupFailed
from kiln.gpu_worker.pipelines import prepare_pipeline
from kiln.gpu_worker.protocol import RankFailed, RankReady
from kiln.gpu_worker.quiet import quiet_known_warnings
from kiln.gpu_worker.rank_server import rank_launch, warm_rank_server
from kiln.gpu_worker.ranks.args import RankArgs, RankPipes
from kiln.gpu_worker.settings import GpuWorkerSettings


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


def wait_for_exit(processes: list[BaseProcess], timeout_s: float) -> None:
    """Wait until these processes have ended, or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    pending = [p for p in processes if p.is_alive()]
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        wait([p.sentinel for p in pending], timeout=remaining)
        pending = [p for p in pending if p.is_alive()]


class RankProcesses:
    """The ranks of one group and the owner's ends of their pipes (filled in as they spawn)."""

    def __init__(self, config: GroupConfig) -> None:
        self.config = config
        self.processes: list[BaseProcess] = []  # in rank order
        self.status: list[Connection] = []  # one per rank
        self.commands: Connection | None = None  # to rank 0
        self.results: Connection | None = None  # from rank 0
        self._death_w: Connection | None = None  # ranks watch for its EOF: held while they live
        self.conns: list[Connection] = []  # every owner-side end, closed at shutdown
        self._store_listener: socket.socket | None = None  # rank 0 serves the store on it
        self.limits: dict[str, DeclaredLimits] = {}  # per pipeline, as rank 0 loaded it
        self.input_schemas: dict[str, InputSchema] = {}  # per pipeline that declares one

    def prepare_pipelines(self) -> None:
        """Build what the pipelines load from; raise `RankStartupFailed` naming the pipeline."""
        # Here, outside any process group: a pipeline built inside one is saved whole only on
        # rank 0 (transformers), and ranks racing to build the same cache is wasted work.
        settings = self.config.settings or GpuWorkerSettings()
        warm_rank_server(settings.rank_start, self.config.pipelines.values())  # overlaps the below
        quiet_known_warnings()  # building a pipeline here prints what each rank would
        for name, spec in self.config.pipelines.items():
            try:
                prepare_pipeline(spec, settings)
            except Exception as exc:
                raise RankStartupFailed(
                    f"pipeline {name} ({spec}) could not be prepared: {exc}"
                ) from exc

    def spawn(self) -> None:
        """Start one process per device; each is tracked as soon as it runs."""
        settings = self.config.settings or GpuWorkerSettings()
        launch = rank_launch(settings.rank_start, self.config.pipelines.values())
        ctx = launch.context
        world = self.config.world()
        # The group's store: bound here to a port the kernel chose (no port race between ranks)
        # and listening before any rank starts; rank 0 serves it (`ranks.start.join_group`).
        # The node keeps its copy until `close`, after every rank ended: the port stays this
        # group's while a rank may still try to reach it, and a start that raises leaks nothing.
        listener = self._store_listener = socket.create_server(("127.0.0.1", 0))
        death_r, self._death_w = ctx.Pipe(duplex=False)
        commands_r, self.commands = ctx.Pipe(duplex=False)
        self.results, results_w = ctx.Pipe(duplex=False)
        for rank, device in enumerate(world):
            status_r, status_w = ctx.Pipe(duplex=False)
            pipes = RankPipes(status_w, death_r)
            if rank == 0:
                pipes.commands, pipes.results = commands_r, results_w
                pipes.store_listener = listener
            process = launch.process(self._rank_args(rank, device), pipes, f"kiln-rank{rank}")
            process.start()
            launch.started(process)
            status_w.close()  # the child holds its own copy; ours would hide the child's EOF
            self.processes.append(process)
            self.status.append(status_r)
        for end in (death_r, commands_r, results_w):
            end.close()
        self.conns = [self.commands, self.results, self._death_w, *self.status]

    def _rank_args(self, rank: int, device: str) -> RankArgs:
        config = self.config
        assert self._store_listener is not None
        return RankArgs(
            rank=rank,
            world_size=len(config.world()),
            device=device,
            backend=config.backend(),
            store_port=self._store_listener.getsockname()[1],
            pipelines=dict(config.pipelines),
            parallel=config.parallel,
            node_name=config.node_name,
            threads=config.threads_per_rank(),
            parent_pid=os.getpid(),
            collective_timeout_s=config.collective_timeout_s,
            verdict_wait_s=config.verdict_wait_s,
            warmup=config.warmup,
            settings=config.settings,
            log_format=config.log_format,
            log_level=config.log_level,
        )

    def await_ready(self) -> None:
        """Wait for every rank's `RankReady`; raise `RankStartupFailed` on anything else."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        waiting = dict(enumerate(self.status))
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RankStartupFailed(
                    f"ranks {sorted(waiting)} not ready after {self.config.ready_timeout_s:.0f} s"
                )
            sentinels = {self.processes[rank].sentinel: rank for rank in waiting}
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
                self.input_schemas = dict(message.inputs)
            del waiting[rank]
        elif isinstance(message, RankFailed):
            raise RankStartupFailed(f"rank {rank} failed to start:\n{message.message}")
        elif message is None and conn.poll(0) is False and self.processes[rank].is_alive():
            return  # woken by nothing we can read yet
        else:
            self.processes[rank].join(timeout=1.0)  # EOF on the pipe: the rank is ending
            exit_text = describe_exit(self.processes[rank].exitcode)
            raise RankStartupFailed(f"rank {rank} ended before it was ready ({exit_text})")

    def close(self) -> None:
        """Close every owner-side pipe end, and the store's listening socket."""
        for conn in self.conns:
            conn.close()
        if self._store_listener is not None:
            self._store_listener.close()
