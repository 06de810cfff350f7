"""Division of one forward's work across the ranks of a group.

- `auto` (the default): on one rank, `none`. On several, each forward is divided: its rows are
  split when they divide evenly by the ranks; otherwise it runs context parallel when the model
  has a plan the ranks can run and this forward's sequence divides by the ranks; otherwise its
  rows are split unevenly (`auto`).
- `batch`: every denoiser call's batch rows are split across the ranks and all-gathered (`rows`).
- `context`: diffusers' sequence parallelism, Ulysses or ring attention, for models that ship a
  context-parallel plan (`context`).
- `none`: every rank computes the whole forward; for one rank (`GroupConfig` refuses it on more).

`apply_parallel` (`apply`) wraps a pipeline's denoiser for its mode (`spec`); every mode counts
the denoiser's calls and rows on each rank (`counters`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.gpu_worker.lazy_exports import lazy_exports

# The configured spec is torch-free, and the node reads it; the rest is the ranks' (torch), so it
# is imported lazily (PEP 562): a node that only parses `--parallel` never imports torch.
from kiln.gpu_worker.parallel.spec import PARALLEL_MODES, ContextKind, ParallelMode, ParallelSpec

if TYPE_CHECKING:
    from kiln.gpu_worker.parallel.apply import apply_parallel
    from kiln.gpu_worker.parallel.counters import DenoiserCounters, denoiser_counters
    from kiln.gpu_worker.parallel.rows import split_sizes

_EXPORTS = {
    "apply_parallel": "kiln.gpu_worker.parallel.apply",
    "DenoiserCounters": "kiln.gpu_worker.parallel.counters",
    "denoiser_counters": "kiln.gpu_worker.parallel.counters",
    "split_sizes": "kiln.gpu_worker.parallel.rows",
}

__all__ = [
    "PARALLEL_MODES",
    "ContextKind",
    "DenoiserCounters",
    "ParallelMode",
    "ParallelSpec",
    "apply_parallel",
    "denoiser_counters",
    "split_sizes",
]


if not TYPE_CHECKING:  # mypy sees the imports above, and so still refuses a misspelled name
    __getattr__ = lazy_exports(__name__, _EXPORTS)
