"""Row split: each rank computes a contiguous slice of a denoiser call's batch rows.

The rows are the CFG unconditional/conditional halves and the multiple outputs. The slices are
all-gathered, so every rank holds the same full prediction and steps its scheduler identically.
Uneven splits are padded for the collective and trimmed after it. A rank with no row (fewer rows
than ranks) computes nothing: it learns the output's layout from rank 0, which always has a row,
and takes its part of the all-gather.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kiln.gpu_worker.parallel.counters import DenoiserCounters

# Keyword arguments that are per-sequence, not per-row, even when their first dimension happens
# to equal the batch size (Flux's position ids, precomputed rotary tables).
_NOT_BATCHED = frozenset({"img_ids", "txt_ids", "image_rotary_emb", "rotary_emb", "freqs_cis"})
_PRIMARY_INPUTS = ("sample", "hidden_states", "x")


def batch_split_forward(
    original: Callable[..., Any], counters: DenoiserCounters, group: dist.ProcessGroup | None
) -> Callable[..., Any]:
    """`original` with every call's batch rows split across the ranks of `group` (mode `batch`)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        rows = batch_rows(args, kwargs)
        if rows is None:  # nothing batch-shaped: every rank computes the same thing
            return original(*args, **kwargs)
        return split_rows(original, args, kwargs, rows, counters, group)

    return forward


def split_rows(
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rows: int,
    counters: DenoiserCounters,
    group: dist.ProcessGroup | None,
) -> Any:
    """One call of `original` on this rank's slice of the rows; every rank gets the whole output."""
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


def batch_rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The batch size of a denoiser call (its primary input's first dimension), if it has one."""
    primary = _primary_input(args, kwargs)
    if isinstance(primary, torch.Tensor) and primary.ndim > 0:
        return int(primary.shape[0])
    return None


def _primary_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else next((kwargs[k] for k in _PRIMARY_INPUTS if k in kwargs), None)


def _input_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    primary = _primary_input(args, kwargs)
    assert isinstance(primary, torch.Tensor)  # only called once `batch_rows` found rows
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
