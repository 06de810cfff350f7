"""The `auto` choice, made per forward: even row split, else context parallel, else uneven rows.

An even row split needs one all-gather and no attention traffic. Context parallel needs a plan
the ranks can run (on CPU: Ulysses, heads divisible by the ranks) and a sequence that divides by
the ranks; a model without a usable plan is always split by rows. No row is computed twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kiln.gpu_worker.parallel.context import ContextSwitch, enable_context_parallel
from kiln.gpu_worker.parallel.counters import DenoiserCounters
from kiln.gpu_worker.parallel.rows import batch_rows, split_rows
from kiln.gpu_worker.parallel.spec import ContextKind

logger = logging.getLogger(__name__)

# diffusers' EquipartitionSharder asserts this when a sequence does not divide by the ranks; it
# fails on every rank alike (same shapes), before the attention's collectives.
UNEVEN_SEQUENCE = "must be divisible by mesh size"


def auto_context(denoiser: torch.nn.Module, kind: ContextKind) -> ContextSwitch | None:
    """Context parallel for `auto`, when this model and these ranks can run it; else None."""
    name = type(denoiser).__name__
    if getattr(denoiser, "_cp_plan", None) is None:
        return None
    if next(denoiser.parameters()).device.type == "cpu":
        kind = "ulysses"  # the only kind CPU attention can run
    try:
        enable_context_parallel(denoiser, kind)
    except ValueError as exc:  # e.g. heads not divisible by ranks: rows are still split
        logger.info("%s: no context parallel (%s); its forwards split rows only", name, exc)
        return None
    return ContextSwitch(denoiser)


def auto_forward(
    original: Callable[..., Any],
    switch: ContextSwitch,
    counters: DenoiserCounters,
    group: dist.ProcessGroup | None,
) -> Callable[..., Any]:
    """`original` dividing each call by rows or by sequence, whichever this call allows."""
    ranks = dist.get_world_size(group)

    def forward(*args: Any, **kwargs: Any) -> Any:
        counters.calls += 1
        rows = batch_rows(args, kwargs)
        if rows is not None and rows % ranks == 0:
            switch.set(False)  # an even row split needs one all-gather, no attention traffic
            return split_rows(original, args, kwargs, rows, counters, group)
        switch.set(True)
        try:
            output = original(*args, **kwargs)
        except AssertionError as exc:
            if rows is None or UNEVEN_SEQUENCE not in str(exc):
                raise
            switch.set(False)  # this sequence does not divide by the ranks: split rows instead
            return split_rows(original, args, kwargs, rows, counters, group)
        counters.rows += rows or 0
        counters.context_calls += 1
        return output

    return forward
