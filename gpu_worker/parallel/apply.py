"""`apply_parallel`: wrap a pipeline's denoiser for the group's parallel mode, once per pipeline."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kiln.gpu_worker.parallel.auto import auto_context, auto_forward
from kiln.gpu_worker.parallel.context import enable_context_parallel
from kiln.gpu_worker.parallel.counters import COUNTERS_ATTR, DenoiserCounters
from kiln.gpu_worker.parallel.rows import batch_rows, batch_split_forward
from kiln.gpu_worker.parallel.spec import ParallelSpec
from kiln.gpu_worker.pipelines.base import Pipeline


def apply_parallel(
    pipeline: Pipeline, spec: ParallelSpec, group: dist.ProcessGroup | None = None
) -> None:
    """Make `pipeline`'s denoiser work as one of the group's ranks; once per loaded pipeline.

    `group` carries the tensor collectives on the pipeline's device (gloo for CPU ranks, nccl for
    CUDA); None means the default group. Context parallel always spans the default group.
    """
    denoiser = pipeline.denoiser()
    if denoiser is None:
        if spec.mode in ("none", "auto"):
            return  # nothing to divide; a pipeline without a denoiser module runs as it is
        raise ValueError(f"{pipeline.name}: no denoiser module, so no {spec.mode} parallelism")
    if hasattr(denoiser, COUNTERS_ATTR):
        raise RuntimeError(f"{pipeline.name}: parallelism is already applied")
    counters = DenoiserCounters()
    wrapped = _wrap_forward(denoiser, spec, counters, group)
    # An instance attribute shadows the class method: `.config`, `.dtype`, hooks keep working.
    denoiser.forward = wrapped
    setattr(denoiser, COUNTERS_ATTR, counters)


def _wrap_forward(
    denoiser: torch.nn.Module,
    spec: ParallelSpec,
    counters: DenoiserCounters,
    group: dist.ProcessGroup | None,
) -> Callable[..., Any]:
    ranks = _group_size(group)
    if spec.mode == "none" or (spec.mode == "auto" and ranks == 1):
        return counting_forward(denoiser.forward, counters, context=False)
    if spec.mode == "batch":
        return batch_split_forward(denoiser.forward, counters, group)
    if spec.mode == "context":
        enable_context_parallel(denoiser, spec.context_kind)
        return counting_forward(denoiser.forward, counters, context=ranks > 1)
    switch = auto_context(denoiser, spec.context_kind)
    if switch is None:
        return batch_split_forward(denoiser.forward, counters, group)
    # Captured after enabling: diffusers' root hook replaces `forward` with the hooked one.
    return auto_forward(denoiser.forward, switch, counters, group)


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def counting_forward(
    original: Callable[..., Any], counters: DenoiserCounters, context: bool
) -> Callable[..., Any]:
    """`original`, counted: every rank runs the whole call (`context`: on its sequence slice)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        counters.rows += batch_rows(args, kwargs) or 0
        counters.context_calls += int(context)
        return original(*args, **kwargs)

    return forward
