"""Starting a rank, alike on every rank: join, load and parallelise every pipeline, warm up.

Besides the default process group (the tensor collectives: gloo on CPU, nccl on CUDA), a group of
several ranks opens two gloo CPU groups: the idle group, whose timeout is effectively infinite so
a follower can wait in it for the next batch however long, and the control group, with the
collective timeout, for per-step decisions and outcomes.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kiln.gpu_worker.parallel import apply_parallel
from kiln.gpu_worker.pipeline_specs import PipelineFailed, PipelineRefused, SpecError, one_line
from kiln.gpu_worker.pipelines import Pipeline, load_pipeline
from kiln.gpu_worker.pipelines.compile import (
    compile_denoiser,
    save_compile_cache,
    use_compile_cache,
)
from kiln.gpu_worker.ranks.args import RankArgs
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.gpu_worker.warmup import parse_warmup_shape, warm_up

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = datetime.timedelta(days=3650)  # idle ranks wait for work, however long


@dataclass
class RankRuntime:
    """A started rank: its device, its resident pipelines and its two CPU groups."""

    args: RankArgs
    device: torch.device
    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    idle_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None
    asleep: str | None = None  # the sleep mode while asleep (gpu_worker/ranks/sleep.py)


def start_rank(args: RankArgs, store_listener: socket.socket | None = None) -> RankRuntime:
    """Join the group, load and parallelise every pipeline, warm each one up.

    `store_listener`: rank 0's, the bound socket the group's store serves on (`join_group`).
    """
    runtime = join_group(args, store_listener)
    settings = args.settings or GpuWorkerSettings()
    if settings.compile:
        use_compile_cache(settings.compile_cache())
    load_resident(runtime)
    if args.warmup:
        started = time.monotonic()
        shapes = tuple(parse_warmup_shape(text) for text in settings.warmup)
        for name, pipeline in runtime.pipelines.items():
            try:
                warm_up(name, pipeline, shapes)
            except Exception as exc:  # the pipeline's first run: one line, the traceback at debug
                logger.debug("pipeline %s: warm-up failed", name, exc_info=True)
                raise PipelineFailed(name, f"warm-up raised {one_line(exc)}") from None
        if settings.compile and args.rank == 0:
            save_compile_cache(settings.compile_cache(), time.monotonic() - started)
    return runtime


def load_resident(runtime: RankRuntime) -> None:
    """Load each pipeline, compile (`KILN_COMPILE`) and parallelise its denoiser; start, wake.

    A spec that loads no pipeline raises `PipelineRefused` naming it (one line, no traceback);
    one whose loading raises, `PipelineFailed` (the same, the traceback logged at debug).
    """
    args = runtime.args
    settings = args.settings or GpuWorkerSettings()
    for name, spec in args.pipelines.items():
        try:
            pipeline = load_pipeline(spec, runtime.device, args.settings)
        except SpecError as exc:  # the spec's fault, e.g. a factory that made no pipeline
            raise PipelineRefused(name, str(exc)) from None
        except Exception as exc:  # the model's files or the factory raised: one line, not 136
            logger.debug("pipeline %s: loading %s failed", name, spec, exc_info=True)
            raise PipelineFailed(name, f"loading {spec} raised {one_line(exc)}") from None
        if settings.compile:
            compile_denoiser(pipeline, settings.compile_mode)
        if pipeline.denoiser() is None and args.parallel.mode != "none":
            # Nothing to divide (a custom pipeline without a denoiser module): every rank
            # computes the whole batch, which is still correct, only not faster.
            logger.warning("pipeline %s has no denoiser; it runs unsplit on every rank", name)
        else:
            apply_parallel(pipeline, args.parallel, None)
        runtime.pipelines[name] = pipeline


def join_group(args: RankArgs, store_listener: socket.socket | None = None) -> RankRuntime:
    """Take the device, join the default process group and open the two CPU groups.

    Rank 0 hosts the group's store on `store_listener`, a socket the node bound to a port the
    kernel chose (no port race) and listening before any rank started, so the others may connect
    at once; the node need not import torch to host it (docs/architecture.md).
    """
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.collective_timeout_s)
    if (args.rank == 0) != (store_listener is not None):
        raise ValueError(f"rank {args.rank}: only rank 0 serves the store, and it must")
    listen_fd = None
    if store_listener is not None:
        # Not inherited by what this rank starts (inductor's compile workers), and owned by the
        # store from here on (it closes the descriptor): Python must not close it as well.
        store_listener.set_inheritable(False)
        listen_fd = store_listener.detach()
    store = dist.TCPStore(
        "127.0.0.1",
        args.store_port,
        args.world_size,
        is_master=listen_fd is not None,
        timeout=timeout,
        wait_for_workers=False,  # the master's: the ranks meet in init_process_group
        master_listen_fd=listen_fd,
    )
    dist.init_process_group(
        args.backend, store=store, rank=args.rank, world_size=args.world_size, timeout=timeout
    )
    runtime = RankRuntime(args, device)
    if args.world_size > 1:
        runtime.idle_group = _gloo_group(IDLE_TIMEOUT)
        runtime.control_group = _gloo_group(timeout)
    return runtime


def _gloo_group(timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A gloo group of every rank (torch 2.14 types `new_group` as maybe its non-member mark)."""
    group = dist.new_group(backend="gloo", timeout=timeout)
    if not isinstance(group, dist.ProcessGroup):  # every rank is a member: never the case
        raise RuntimeError(f"torch.distributed.new_group gave a member rank {group!r}")
    return group
