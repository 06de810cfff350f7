"""Division of one forward's work across the ranks of a group.

- `auto` (the default): on one rank, `none`. On several, each forward is divided: its rows are
  split when they divide evenly by the ranks (one all-gather, no attention traffic); otherwise
  it runs context parallel when the model has a plan the ranks can run (on CPU: Ulysses, heads
  divisible by the ranks) and this forward's sequence divides by the ranks; otherwise its rows
  are split unevenly. A model without a usable plan is always split by rows. No row is computed
  twice (a rank short of a row sits the forward out).
- `batch`: the denoiser's `forward` is wrapped so that each rank computes a contiguous slice of
  the batch rows (the CFG unconditional/conditional halves and the multiple outputs), then the
  slices are all-gathered, so every rank holds the same full prediction and steps its scheduler
  identically. Uneven splits are padded for the collective and trimmed after it. A rank with no
  row (fewer rows than ranks) computes nothing: it learns the output's layout from rank 0, which
  always has a row, and takes its part of the all-gather.
- `context`: diffusers' sequence parallelism (`ContextParallelConfig`, Ulysses or ring attention)
  for models that ship a context-parallel plan (`_cp_plan`: Wan, LTX, Flux, QwenImage, ...).
  diffusers 0.42's `enable_parallelism` computes `rank % torch.accelerator.device_count()`, which
  divides by zero on a CPU-only build, so on CPU the same steps are done here with diffusers'
  own pieces (`ParallelConfig.setup`, `apply_context_parallel`). On CPU only Ulysses runs: ring
  attention needs an attention backend that returns the log-sum-exp, and torch's native CPU
  attention does not. The CUDA path uses the public `enable_parallelism`.
- `none`: every rank computes the whole forward; for one rank (`GroupConfig` refuses it on more).

Every mode counts the denoiser's calls and rows on each rank (`denoiser_counters`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from gpu_worker.pipelines.base import Pipeline

logger = logging.getLogger(__name__)

ParallelMode = Literal["auto", "none", "batch", "context"]
ContextKind = Literal["ulysses", "ring"]
PARALLEL_MODES: tuple[ParallelMode, ...] = ("auto", "none", "batch", "context")

_COUNTERS_ATTR = "_kiln_denoiser_counters"
# Keyword arguments that are per-sequence, not per-row, even when their first dimension happens
# to equal the batch size (Flux's position ids, precomputed rotary tables).
_NOT_BATCHED = frozenset({"img_ids", "txt_ids", "image_rotary_emb", "rotary_emb", "freqs_cis"})
_PRIMARY_INPUTS = ("sample", "hidden_states", "x")
# diffusers' EquipartitionSharder asserts this when a sequence does not divide by the ranks; it
# fails on every rank alike (same shapes), before the attention's collectives.
_UNEVEN_SEQUENCE = "must be divisible by mesh size"


@dataclass(frozen=True)
class ParallelSpec:
    """How a group divides a forward: auto, none, batch split, or context (sequence) parallel."""

    mode: ParallelMode = "auto"
    context_kind: ContextKind = "ulysses"

    def __post_init__(self) -> None:
        if self.mode not in PARALLEL_MODES:
            raise ValueError(f"parallel mode must be {'|'.join(PARALLEL_MODES)}, got {self.mode!r}")
        if self.context_kind not in ("ulysses", "ring"):
            raise ValueError(f"context_kind must be ulysses|ring, got {self.context_kind!r}")


@dataclass
class DenoiserCounters:
    """Work done by this rank's denoiser since the last reset."""

    calls: int = 0
    rows: int = 0  # batch rows computed for a result (a context-parallel row counts whole)
    idle_calls: int = 0  # forwards sat out: fewer rows than ranks left this rank none
    context_calls: int = 0  # forwards run context parallel (a slice of every row's sequence)

    def reset(self) -> None:
        """Zero every counter."""
        self.calls = self.rows = self.idle_calls = self.context_calls = 0


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
    if hasattr(denoiser, _COUNTERS_ATTR):
        raise RuntimeError(f"{pipeline.name}: parallelism is already applied")
    counters = DenoiserCounters()
    wrapped = _wrap_forward(denoiser, spec, counters, group)
    # An instance attribute shadows the class method: `.config`, `.dtype`, hooks keep working.
    denoiser.forward = wrapped
    setattr(denoiser, _COUNTERS_ATTR, counters)


def denoiser_counters(pipeline: Pipeline) -> DenoiserCounters | None:
    """This rank's counters, or None when `apply_parallel` did not wrap the pipeline."""
    denoiser = pipeline.denoiser()
    return getattr(denoiser, _COUNTERS_ATTR, None) if denoiser is not None else None


def _wrap_forward(
    denoiser: torch.nn.Module,
    spec: ParallelSpec,
    counters: DenoiserCounters,
    group: dist.ProcessGroup | None,
) -> Callable[..., Any]:
    ranks = _group_size(group)
    if spec.mode == "none" or (spec.mode == "auto" and ranks == 1):
        return _counting_forward(denoiser.forward, counters, context=False)
    if spec.mode == "batch":
        return _batch_split_forward(denoiser.forward, counters, group)
    if spec.mode == "context":
        _enable_context_parallel(denoiser, spec.context_kind)
        return _counting_forward(denoiser.forward, counters, context=ranks > 1)
    switch = _auto_context(denoiser, spec.context_kind)
    if switch is None:
        return _batch_split_forward(denoiser.forward, counters, group)
    # Captured after enabling: diffusers' root hook replaces `forward` with the hooked one.
    return _auto_forward(denoiser.forward, switch, counters, group)


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _counting_forward(
    original: Callable[..., Any], counters: DenoiserCounters, context: bool
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        counters.rows += _batch_rows(args, kwargs) or 0
        counters.context_calls += int(context)
        return original(*args, **kwargs)

    return forward


def _batch_split_forward(
    original: Callable[..., Any], counters: DenoiserCounters, group: dist.ProcessGroup | None
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        rows = _batch_rows(args, kwargs)
        if rows is None:  # nothing batch-shaped: every rank computes the same thing
            return original(*args, **kwargs)
        return _split_rows(original, args, kwargs, rows, counters, group)

    return forward


def _auto_forward(
    original: Callable[..., Any],
    switch: _ContextSwitch,
    counters: DenoiserCounters,
    group: dist.ProcessGroup | None,
) -> Callable[..., Any]:
    ranks = dist.get_world_size(group)

    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        rows = _batch_rows(args, kwargs)
        if rows is not None and rows % ranks == 0:
            switch.set(False)  # an even row split needs one all-gather, no attention traffic
            return _split_rows(original, args, kwargs, rows, counters, group)
        switch.set(True)
        try:
            output = original(*args, **kwargs)
        except AssertionError as exc:
            if rows is None or _UNEVEN_SEQUENCE not in str(exc):
                raise
            switch.set(False)  # this sequence does not divide by the ranks: split rows instead
            return _split_rows(original, args, kwargs, rows, counters, group)
        counters.rows += rows or 0
        counters.context_calls += 1
        return output

    return forward


def _split_rows(
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rows: int,
    counters: DenoiserCounters,
    group: dist.ProcessGroup | None,
) -> Any:
    rank = dist.get_rank(group)
    sizes = split_sizes(rows, dist.get_world_size(group))
    start = sum(sizes[:rank])
    stop = start + sizes[rank]
    local: Any = None
    if sizes[rank]:
        counters.rows += sizes[rank]
        local = original(
            *_take_rows(args, rows, start, stop), **_take_rows(kwargs, rows, start, stop)
        )
    else:
        counters.idle_calls += 1
    if 0 in sizes:
        local = _share_layout(local, sizes[0], _input_device(args, kwargs), group)
    return _gather(local, sizes[rank], sizes, group)


def split_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank for a contiguous split: the first `rows % world` ranks get one more."""
    base, extra = divmod(rows, world)
    return [base + (1 if rank < extra else 0) for rank in range(world)]


def _batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    primary = _primary_input(args, kwargs)
    if isinstance(primary, torch.Tensor) and primary.ndim > 0:
        return int(primary.shape[0])
    return None


def _primary_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else next((kwargs[k] for k in _PRIMARY_INPUTS if k in kwargs), None)


def _input_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    primary = _primary_input(args, kwargs)
    assert isinstance(primary, torch.Tensor)  # only called once `_batch_rows` found rows
    return primary.device


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


def _share_layout(
    local: Any, leader_rows: int, device: torch.device, group: dist.ProcessGroup | None
) -> Any:
    """Rank 0's output layout to the ranks that computed nothing: row tensors empty, the rest whole.

    One small object broadcast per forward, and only while a forward has fewer rows than ranks.
    """
    holder = [_layout(local, leader_rows) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(holder, group_src=0, group=group)
    return local if local is not None else _to_device(holder[0], device)


def _layout(value: Any, local_rows: int) -> Any:
    if isinstance(value, torch.Tensor):
        if value.ndim > 0 and value.shape[0] == local_rows:
            return torch.empty((0, *value.shape[1:]), dtype=value.dtype)
        return value.detach().cpu()  # not per row: every rank gets rank 0's
    if isinstance(value, dict):
        return type(value)(**{key: _layout(item, local_rows) for key, item in value.items()})
    if type(value) in (tuple, list):
        return type(value)(_layout(item, local_rows) for item in value)
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)(**{key: _to_device(item, device) for key, item in value.items()})
    if type(value) in (tuple, list):
        return type(value)(_to_device(item, device) for item in value)
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


def _auto_context(denoiser: torch.nn.Module, kind: ContextKind) -> _ContextSwitch | None:
    """Context parallel for `auto`, when this model and these ranks can run it; else None."""
    name = type(denoiser).__name__
    if getattr(denoiser, "_cp_plan", None) is None:
        return None
    if next(denoiser.parameters()).device.type == "cpu":
        kind = "ulysses"  # the only kind CPU attention can run
    try:
        _enable_context_parallel(denoiser, kind)
    except ValueError as exc:  # e.g. heads not divisible by ranks: rows are still split
        logger.info("%s: no context parallel (%s); its forwards split rows only", name, exc)
        return None
    return _ContextSwitch(denoiser)


class _ContextSwitch:
    """Turns a model's context parallelism off and on between forwards.

    diffusers enables it as hooks on submodules plus a `_parallel_config` on the attention
    processors. Removing the hooks would also reset the model's `forward`, which Kiln's wrapper
    replaced, so the hooks stay registered and their pre/post steps are swapped for pass-through
    ones while it is off (diffusers 0.42 internals: `ModelHook.fn_ref`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from diffusers.hooks.context_parallel import (
            ContextParallelGatherHook,
            ContextParallelSplitHook,
        )

        hook_types = (ContextParallelGatherHook, ContextParallelSplitHook)
        self._refs: list[tuple[Any, Any, Any]] = []
        self._configs: list[tuple[Any, Any]] = []
        for module in model.modules():
            registry: Any = getattr(module, "_diffusers_hook", None)
            hooks = registry.hooks.values() if registry is not None else ()
            for hook in (h for h in hooks if isinstance(h, hook_types)):
                self._refs.append((hook.fn_ref, hook.fn_ref.pre_forward, hook.fn_ref.post_forward))
            for owner in (module, getattr(module, "processor", None)):
                config = getattr(owner, "_parallel_config", None)
                if config is not None:
                    self._configs.append((owner, config))
        self.on = True

    def set(self, on: bool) -> None:
        """Context parallel for the next forwards (`on`), or a plain forward on every rank."""
        if on == self.on:
            return
        for ref, pre, post in self._refs:
            ref.pre_forward, ref.post_forward = (pre, post) if on else (_pass_inputs, _pass_output)
        for owner, config in self._configs:
            owner._parallel_config = config if on else None
        self.on = on


def _pass_inputs(module: Any, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


def _pass_output(module: Any, output: Any) -> Any:
    return output


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
