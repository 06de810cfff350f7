"""How a group divides a forward, as configured: `ParallelSpec` (see `gpu_worker.parallel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ParallelMode = Literal["auto", "none", "batch", "context"]
ContextKind = Literal["ulysses", "ring"]
PARALLEL_MODES: tuple[ParallelMode, ...] = ("auto", "none", "batch", "context")


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
