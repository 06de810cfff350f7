"""One rank of a worker group: join the group, load every pipeline, then serve batches.

Rank 0 (the leader) is the only rank that talks to the coordinator. It relays each batch to the
other ranks (followers) with a broadcast over a gloo CPU group whose timeout is effectively
infinite, so an idle follower sleeps inside that broadcast (gloo waits on a condition variable,
measured at ~0 % CPU). Per-step decisions and outcomes travel over a second gloo group with a
finite timeout: a rank left alone in a collective fails instead of hanging for ever.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.util as mp_util
import os
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from gpu_worker.errors import UnsupportedRequest
from gpu_worker.forward import ForwardResult, LeaderLink, StepSync, run_forward
from gpu_worker.leader import report_batch, screen_batch
from gpu_worker.limits import declared_limits
from gpu_worker.parallel import ParallelSpec, apply_parallel
from gpu_worker.pipelines import Pipeline, load_pipeline
from gpu_worker.protocol import (
    FailureKind,
    GenerationRequest,
    RankFailed,
    RankFault,
    RankReady,
    RunBatch,
    ShutdownGroup,
)
from gpu_worker.rank_process import prepare_rank_process, process_title
from gpu_worker.relay import broadcast_command, exchange_outcomes, receive_command
from gpu_worker.settings import GpuWorkerSettings

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = datetime.timedelta(days=3650)  # idle ranks wait for work, however long
EXIT_FATAL = 71


@dataclass(frozen=True)
class RankArgs:
    """Everything one rank needs to start; pickled once into the spawned process."""

    rank: int
    world_size: int
    device: str
    backend: str
    store_port: int
    pipelines: dict[str, str]
    parallel: ParallelSpec
    node_name: str
    threads: int
    parent_pid: int
    collective_timeout_s: float
    verdict_wait_s: float
    warmup: bool
    settings: GpuWorkerSettings | None = None


@dataclass
class RankPipes:
    """The rank's pipes: status (every rank), commands/results (rank 0), death (read end)."""

    status: Connection
    death: Connection
    commands: Connection | None = None
    results: Connection | None = None


@dataclass
class RankRuntime:
    """A started rank: its device, its resident pipelines and its two CPU groups."""

    args: RankArgs
    device: torch.device
    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    idle_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None


def rank_main(args: RankArgs, pipes: RankPipes) -> None:
    """Entry point of a rank process (the `spawn` target)."""
    title = process_title(args.node_name, args.rank, args.world_size, args.device)
    prepare_rank_process(
        title=title, parent_pid=args.parent_pid, death_pipe=pipes.death, threads=args.threads
    )
    try:
        runtime = start_rank(args)
        limits = {name: declared_limits(pipeline) for name, pipeline in runtime.pipelines.items()}
    except BaseException:
        _send_quietly(pipes.status, RankFailed(args.rank, traceback.format_exc()))
        _exit(1)
    pipes.status.send(RankReady(args.rank, os.getpid(), limits))
    try:
        if args.rank == 0:
            assert pipes.commands is not None and pipes.results is not None
            lead(runtime, LeaderLink(pipes.commands, pipes.results, args.verdict_wait_s), pipes)
        else:
            follow(runtime, pipes)
    except BaseException:
        fault = RankFault(args.rank, None, FailureKind.COLLECTIVE, traceback.format_exc(), True)
        _send_quietly(pipes.status, fault)
        _exit(EXIT_FATAL)
    _exit(0)


def start_rank(args: RankArgs) -> RankRuntime:
    """Join the group, load and parallelise every pipeline, warm each one up."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.collective_timeout_s)
    store = dist.TCPStore(
        "127.0.0.1", args.store_port, args.world_size, is_master=False, timeout=timeout
    )
    dist.init_process_group(
        args.backend, store=store, rank=args.rank, world_size=args.world_size, timeout=timeout
    )
    runtime = RankRuntime(args, device)
    if args.world_size > 1:
        runtime.idle_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        runtime.control_group = dist.new_group(backend="gloo", timeout=timeout)
    for name, spec in args.pipelines.items():
        pipeline = load_pipeline(spec, device, args.settings)
        if pipeline.denoiser() is None and args.parallel.mode != "none":
            # Nothing to divide (a custom pipeline without a denoiser module): every rank
            # computes the whole batch, which is still correct, only not faster.
            logger.warning("pipeline %s has no denoiser; it runs unsplit on every rank", name)
        else:
            apply_parallel(pipeline, args.parallel, None)
        runtime.pipelines[name] = pipeline
    if args.warmup:
        for name, pipeline in runtime.pipelines.items():
            warm_up(name, pipeline)
    return runtime


def warm_up(name: str, pipeline: Pipeline) -> None:
    """One tiny request through the pipeline (every rank alike), so the first job is not slow."""
    for num_frames in (1, 9):
        request = GenerationRequest(
            request_id=f"warmup:{name}",
            pipeline=name,
            prompt="warm-up",
            width=64,
            height=64,
            steps=2,
            seed=0,
            num_frames=num_frames,
        )
        try:
            pipeline.validate(request)
        except UnsupportedRequest:
            continue
        pipeline.run([request], lambda step, total: None)
        return
    logger.info("pipeline %s accepts no small warm-up request; not warmed up", name)


def lead(runtime: RankRuntime, link: LeaderLink, pipes: RankPipes) -> None:
    """Rank 0: take commands from the coordinator, relay batches, report results."""
    args = runtime.args
    while True:
        command = link.next_command()
        if isinstance(command, ShutdownGroup):
            _relay(runtime, command)
            return
        batch = screen_batch(command, runtime.pipelines, link)
        if batch is None:
            continue
        _relay(runtime, batch)
        link.begin(batch.batch_id)
        sync = StepSync(batch, runtime.control_group, link)
        result = _forward(runtime, batch, sync, pipes)
        outcomes = exchange_outcomes(result.outcome, args.world_size, runtime.control_group)
        report_batch(link, batch, outcomes, result, sync.stopped)


def follow(runtime: RankRuntime, pipes: RankPipes) -> None:
    """Ranks other than 0: sleep in the relay broadcast, run what rank 0 sends."""
    args = runtime.args
    while True:
        assert runtime.idle_group is not None  # a follower implies world_size > 1
        command = receive_command(runtime.idle_group)
        if isinstance(command, ShutdownGroup):
            return
        if not isinstance(command, RunBatch):
            raise RuntimeError(f"rank {args.rank}: unexpected relay {command!r}")
        sync = StepSync(command, runtime.control_group, None)
        result = _forward(runtime, command, sync, pipes)
        exchange_outcomes(result.outcome, args.world_size, runtime.control_group)


def _forward(
    runtime: RankRuntime, batch: RunBatch, sync: StepSync, pipes: RankPipes
) -> ForwardResult:
    pipeline = runtime.pipelines[batch.requests[0].pipeline]
    result = run_forward(pipeline, batch, sync, runtime.args.rank, runtime.device)
    outcome = result.outcome
    if outcome.kind is not None:
        # Tell the owner at once: if the other ranks did not fail alike, rank 0 may never get
        # to report, and the coordinator would otherwise only learn of it from a timeout.
        notice = RankFault(outcome.rank, batch.batch_id, outcome.kind, outcome.message, False)
        _send_quietly(pipes.status, notice)
    return result


def _relay(runtime: RankRuntime, command: RunBatch | ShutdownGroup) -> None:
    if runtime.idle_group is not None:
        broadcast_command(command, runtime.idle_group)


def _send_quietly(conn: Connection, message: object) -> None:
    with contextlib.suppress(OSError):  # the parent is gone; nobody is left to tell
        conn.send(message)


def _exit(code: int) -> None:
    # os._exit: interpreter teardown could block in gloo's threads or collectives of dead peers.
    # multiprocessing's finalizers still run, so named semaphores that libraries create (tqdm's
    # lock) are unlinked here and not reported as leaked by the parent's resource tracker.
    with contextlib.suppress(Exception):
        mp_util._run_finalizers(0)  # type: ignore[attr-defined]
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
