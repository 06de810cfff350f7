"""Peak memory of one request on a rank: CUDA allocator peaks and the process's peak RSS.

The CPU peak is the kernel's high-water mark (VmHWM in /proc/self/status). Linux lets a process
reset its own mark by writing "5" to /proc/self/clear_refs; where that is not allowed the mark
covers the process's whole life, which `MemoryUsage.cpu_peak_is_per_request` says.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import torch

_MB = 1024 * 1024
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


@dataclass(frozen=True)
class MemoryUsage:
    """Peaks since the last reset, in MiB; CUDA fields are None on a CPU device."""

    cpu_peak_rss_mb: float
    cpu_peak_is_per_request: bool
    cuda_max_allocated_mb: float | None = None
    cuda_max_reserved_mb: float | None = None

    @property
    def peak_mb(self) -> float:
        """The number for metrics: CUDA peak allocated on a GPU, else peak RSS.

        Allocated, not reserved: the caching allocator keeps what earlier requests reserved, so
        a reserved peak would report the largest request so far rather than this one.
        """
        if self.cuda_max_allocated_mb is not None:
            return self.cuda_max_allocated_mb
        return self.cpu_peak_rss_mb


class PeakMemory:
    """Call `reset()` before a request and `measure()` after it, on the rank's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rss_reset_works = False

    def reset(self) -> None:
        """Start a new measuring window."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._rss_reset_works = _reset_peak_rss()

    def measure(self) -> MemoryUsage:
        """Peaks since the last `reset()` (since process start for RSS if it could not reset)."""
        allocated = reserved = None
        if self.device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(self.device) / _MB
            reserved = torch.cuda.max_memory_reserved(self.device) / _MB
        return MemoryUsage(
            cpu_peak_rss_mb=peak_rss_mb(),
            cpu_peak_is_per_request=self._rss_reset_works,
            cuda_max_allocated_mb=allocated,
            cuda_max_reserved_mb=reserved,
        )


def _reset_peak_rss() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # reported in kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
