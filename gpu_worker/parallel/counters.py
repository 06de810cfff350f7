"""What each rank's denoiser computed, counted by every parallel mode's wrapper.

Kept on the denoiser module itself, so a pipeline carries its counters wherever it goes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.gpu_worker.pipelines.base import Pipeline

COUNTERS_ATTR = "_kiln_denoiser_counters"


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


def denoiser_counters(pipeline: Pipeline) -> DenoiserCounters | None:
    """This rank's counters, or None when `apply_parallel` did not wrap the pipeline."""
    denoiser = pipeline.denoiser()
    return getattr(denoiser, COUNTERS_ATTR, None) if denoiser is not None else None
