"""Division of one forward's work across the ranks of a group.

- `batch`: the denoiser's `forward` is wrapped so that each rank computes a contiguous slice of
  the batch rows (the CFG unconditional/conditional halves and the multiple outputs), then the
  slices are all-gathered, so every rank holds the same full prediction and steps its scheduler
  identically. Uneven splits are padded for the collective and trimmed after it.
- `context`: diffusers' sequence parallelism (`ContextParallelConfig`, Ulysses or ring attention)
  for models that ship a context-parallel plan (`_cp_plan`: Wan, LTX, Flux, QwenImage, ...).
  diffusers 0.42's `enable_parallelism` computes `rank % torch.accelerator.device_count()`, which
  divides by zero on a CPU-only build, so on CPU the same steps are done here with diffusers'
  own pieces (`ParallelConfig.setup`, `apply_context_parallel`). On CPU only Ulysses runs: ring
  attention needs an attention backend that returns the log-sum-exp, and torch's native CPU
  attention does not. The CUDA path uses the public `enable_parallelism`.

Every mode counts the denoiser's calls and rows on each rank (`denoiser_counters`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from gpu_worker.pipelines.base import Pipeline

ParallelMode = Literal["none", "batch", "context"]
ContextKind = Literal["ulysses", "ring"]

_COUNTERS_ATTR = "_kiln_denoiser_counters"
# Keyword arguments that are per-sequence, not per-row, even when their first dimension happens
# to equal the batch size (Flux's position ids, precomputed rotary tables).
_NOT_BATCHED = frozenset({"img_ids", "txt_ids", "image_rotary_emb", "rotary_emb", "freqs_cis"})
_PRIMARY_INPUTS = ("sample", "hidden_states", "x")


@dataclass(frozen=True)
class ParallelSpec:
    """How a group divides a forward: none, batch split, or context (sequence) parallel."""

    mode: ParallelMode = "none"
    context_kind: ContextKind = "ulysses"

    def __post_init__(self) -> None:
        if self.mode not in ("none", "batch", "context"):
            raise ValueError(f"parallel mode must be none|batch|context, got {self.mode!r}")
        if self.context_kind not in ("ulysses", "ring"):
            raise ValueError(f"context_kind must be ulysses|ring, got {self.context_kind!r}")


@dataclass
class DenoiserCounters:
    """Work done by this rank's denoiser since the last reset."""

    calls: int = 0
    rows: int = 0  # batch rows computed for a result
    padding_rows: int = 0  # rows computed only to keep a collective in step (batch < ranks)

    def reset(self) -> None:
        """Zero every counter."""
        self.calls = self.rows = self.padding_rows = 0


def apply_parallel(
    pipeline: Pipeline, spec: ParallelSpec, group: dist.ProcessGroup | None = None
) -> None:
    """Make `pipeline`'s denoiser work as one of the group's ranks; once per loaded pipeline.

    `group` carries the tensor collectives on the pipeline's device (gloo for CPU ranks, nccl for
    CUDA); None means the default group. Context parallel always spans the default group.
    """
    denoiser = pipeline.denoiser()
    if denoiser is None:
        if spec.mode == "none":
            return
        raise ValueError(f"{pipeline.name}: no denoiser module, so no {spec.mode} parallelism")
    if hasattr(denoiser, _COUNTERS_ATTR):
        raise RuntimeError(f"{pipeline.name}: parallelism is already applied")
    counters = DenoiserCounters()
    if spec.mode == "context":
        _enable_context_parallel(denoiser, spec.context_kind)
    if spec.mode == "batch":
        wrapped = _batch_split_forward(denoiser.forward, counters, group)
    else:
        wrapped = _counting_forward(denoiser.forward, counters)
    # An instance attribute shadows the class method: `.config`, `.dtype`, hooks keep working.
    denoiser.forward = wrapped
    setattr(denoiser, _COUNTERS_ATTR, counters)


def denoiser_counters(pipeline: Pipeline) -> DenoiserCounters | None:
    """This rank's counters, or None when `apply_parallel` did not wrap the pipeline."""
    denoiser = pipeline.denoiser()
    return getattr(denoiser, _COUNTERS_ATTR, None) if denoiser is not None else None


def _counting_forward(
    original: Callable[..., Any], counters: DenoiserCounters
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        counters.rows += _batch_rows(args, kwargs) or 0
        return original(*args, **kwargs)

    return forward


def _batch_split_forward(
    original: Callable[..., Any], counters: DenoiserCounters, group: dist.ProcessGroup | None
) -> Callable[..., Any]:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)

    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        rows = _batch_rows(args, kwargs)
        if rows is None:  # nothing batch-shaped: every rank computes the same thing
            return original(*args, **kwargs)
        sizes = split_sizes(rows, world)
        start = sum(sizes[:rank])
        stop = start + sizes[rank]
        if sizes[rank] == 0:
            # More ranks than rows: compute one row anyway to learn the output's shape for the
            # all-gather; it is dropped after.
            start, stop = rows - 1, rows
            counters.padding_rows += 1
        counters.rows += sizes[rank]
        local = original(
            *_take_rows(args, rows, start, stop), **_take_rows(kwargs, rows, start, stop)
        )
        return _gather(local, stop - start, sizes, group)

    return forward


def split_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank for a contiguous split: the first `rows % world` ranks get one more."""
    base, extra = divmod(rows, world)
    return [base + (1 if rank < extra else 0) for rank in range(world)]


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    primary = args[0] if args else next((kwargs[k] for k in _PRIMARY_INPUTS if k in kwargs), None)
    if isinstance(primary, torch.Tensor) and primary.ndim > 0:
        return int(primary.shape[0])
    return None


def _take_rows(value: Any, rows: int, start: int, stop: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.ndim > 0 and value.shape[0] == rows else value
    if isinstance(value, dict):
        return {
            key: item if key in _NOT_BATCHED else _take_rows(item, rows, start, stop)
            for key, item in value.items()
        }
    if type(value) in (tuple, list):
        return type(value)(_take_rows(item, rows, start, stop) for item in value)
    return value


def _gather(value: Any, local_rows: int, sizes: list[int], group: dist.ProcessGroup | None) -> Any:
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 or value.shape[0] != local_rows:
            return value
        return _all_gather_rows(value, sizes, group)
    if isinstance(value, dict):  # diffusers' BaseOutput is an OrderedDict
        gathered = {key: _gather(item, local_rows, sizes, group) for key, item in value.items()}
        return type(value)(**gathered)
    if type(value) in (tuple, list):
        return type(value)(_gather(item, local_rows, sizes, group) for item in value)
    return value


def _all_gather_rows(
    local: torch.Tensor, sizes: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    rank = dist.get_rank(group)
    width = max(sizes)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: sizes[rank]] = local[: sizes[rank]]
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([part[:size] for part, size in zip(parts, sizes, strict=True)])


def _enable_context_parallel(denoiser: torch.nn.Module, kind: ContextKind) -> None:
    from diffusers import ContextParallelConfig

    # Configuration errors first, before any collective: they must show even with one rank.
    name = type(denoiser).__name__
    if getattr(denoiser, "_cp_plan", None) is None:
        raise ValueError(f"{name} has no context-parallel plan in diffusers; use mode 'batch'")
    device = next(denoiser.parameters()).device
    if kind == "ring" and device.type == "cpu":
        raise ValueError(
            "ring attention does not run on CPU (native CPU attention returns no log-sum-exp); "
            "use context_kind 'ulysses' on CPU ranks"
        )
    world = dist.get_world_size()
    if world == 1:
        return  # one rank: the whole sequence is local
    heads = getattr(getattr(denoiser, "config", None), "num_attention_heads", None)
    if kind == "ulysses" and heads is not None and heads % world:
        raise ValueError(f"Ulysses needs attention heads ({heads}) divisible by ranks ({world})")
    if kind == "ring":
        config = ContextParallelConfig(ring_degree=world)
    else:
        config = ContextParallelConfig(ulysses_degree=world)
    if device.type == "cpu":
        _enable_cpu_context_parallel(denoiser, config, device)
    else:
        denoiser.enable_parallelism(config=config)  # type: ignore[operator]


def _enable_cpu_context_parallel(
    denoiser: torch.nn.Module, config: Any, device: torch.device
) -> None:
    # What `ModelMixin.enable_parallelism` does, minus its accelerator-only device lookup.
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    model: Any = denoiser  # diffusers' ModelMixin attributes are untyped
    mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
    parallel_config = ParallelConfig(context_parallel_config=config)
    parallel_config.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
    model._parallel_config = parallel_config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = parallel_config
    apply_context_parallel(model, config, model._cp_plan)
