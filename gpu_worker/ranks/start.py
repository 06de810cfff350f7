"""Starting a rank, alike on every rank: join, load and parallelise every pipeline, warm up.

Besides the default process group (the tensor collectives: gloo on CPU, nccl on CUDA), a group of
several ranks opens two gloo CPU groups: the idle group, whose timeout is effectively infinite so
a follower can wait in it for the next batch however long, and the control group, with the
collective timeout, for per-step decisions and outcomes.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.parallel import ParallelSpec, apply_parallel
from kiln.gpu_worker.pipelines import Pipeline, load_pipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = datetime.timedelta(days=3650)  # idle ranks wait for work, however long
# Above 1, so the warm-up also runs the classifier-free-guidance path real requests take.
WARMUP_GUIDANCE = 5.0


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
    log_format: str = "text"
    log_level: str = "INFO"


@dataclass
class RankRuntime:
    """A started rank: its device, its resident pipelines and its two CPU groups."""

    args: RankArgs
    device: torch.device
    pipelines: dict[str, Pipeline] = field(default_factory=dict)
    idle_group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None


def start_rank(args: RankArgs) -> RankRuntime:
    """Join the group, load and parallelise every pipeline, warm each one up."""
    runtime = join_group(args)
    for name, spec in args.pipelines.items():
        pipeline = load_pipeline(spec, runtime.device, args.settings)
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


def join_group(args: RankArgs) -> RankRuntime:
    """Take the device, join the default process group and open the two CPU groups."""
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
            guidance_scale=WARMUP_GUIDANCE,
        )
        try:
            pipeline.validate(request)
        except UnsupportedRequest:
            continue
        pipeline.run([request], lambda _step, _total: None)
        return
    logger.info("pipeline %s accepts no small warm-up request; not warmed up", name)
