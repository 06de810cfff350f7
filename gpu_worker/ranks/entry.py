"""The spawn target of every rank (`rank_main`): start, announce readiness, serve its role, exit.

What a rank tells its owner over its status pipe: `RankReady` (with its pipelines' limits) or
`RankFailed` at start (its traceback, or the one line of a `PipelineRefused`), and a fatal
`RankFault` when its serving loop ends in an error.
"""

from __future__ import annotations

import os
import traceback

from kiln.common.tracing import start_tracing
from kiln.gpu_worker.limits import declared_limits
from kiln.gpu_worker.logs import configure_rank_logging
from kiln.gpu_worker.pipeline_specs import PipelineFailed, PipelineRefused
from kiln.gpu_worker.pipelines.announced import announced_schema
from kiln.gpu_worker.protocol import FailureKind, RankFailed, RankFault, RankReady
from kiln.gpu_worker.ranks.args import RankArgs, RankPipes
from kiln.gpu_worker.ranks.follower import follow
from kiln.gpu_worker.ranks.leader import LeaderLink, lead
from kiln.gpu_worker.ranks.process import (
    exit_rank,
    prepare_rank_process,
    process_title,
    send_quietly,
)
from kiln.gpu_worker.ranks.start import start_rank

EXIT_FATAL = 71


def rank_main(args: RankArgs, pipes: RankPipes) -> None:
    """Entry point of a rank process (the `spawn` target)."""
    configure_rank_logging(args.log_format, args.log_level, node_id=args.node_name, rank=args.rank)
    if args.rank == 0:  # rank 0 makes the ranks' spans (kiln/common/tracing.py)
        start_tracing("kiln-rank")
    title = process_title(args.node_name, args.rank, args.world_size, args.device)
    prepare_rank_process(
        title=title, parent_pid=args.parent_pid, death_pipe=pipes.death, threads=args.threads
    )
    try:
        runtime = start_rank(args, pipes.store_listener)
        limits = {name: declared_limits(pipeline) for name, pipeline in runtime.pipelines.items()}
        inputs = {name: announced_schema(p) for name, p in runtime.pipelines.items()}
    except (PipelineRefused, PipelineFailed) as exc:  # said in one line (traceback at debug)
        send_quietly(pipes.status, RankFailed(args.rank, exc.rank_message()))
        exit_rank(1)
    except BaseException:
        send_quietly(pipes.status, RankFailed(args.rank, traceback.format_exc()))
        exit_rank(1)
    pipes.status.send(RankReady(args.rank, os.getpid(), limits, inputs))
    try:
        if args.rank == 0:
            assert pipes.commands is not None
            assert pipes.results is not None
            link = LeaderLink(pipes.commands, pipes.results, args.verdict_wait_s)
            lead(runtime, link, pipes.status)
        else:
            follow(runtime, pipes.status)
    except BaseException:
        fault = RankFault(args.rank, None, FailureKind.COLLECTIVE, traceback.format_exc(), True)
        send_quietly(pipes.status, fault)
        exit_rank(EXIT_FATAL)
    exit_rank(0)
