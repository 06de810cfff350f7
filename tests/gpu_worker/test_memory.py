"""Peak memory per request: the CPU high-water mark resets between requests."""

from __future__ import annotations

import numpy as np
import torch

from kiln.gpu_worker.memory import MemoryUsage, PeakMemory, peak_rss_mb


def test_cpu_peak_follows_an_allocation_and_resets() -> None:
    peak = PeakMemory(torch.device("cpu"))
    peak.reset()
    baseline = peak.measure()
    assert baseline.cuda_max_allocated_mb is None
    assert baseline.cuda_max_reserved_mb is None
    block = np.ones(64 * 1024 * 1024, dtype=np.uint8)  # 64 MiB, touched
    del block
    grown = peak.measure()
    assert grown.cpu_peak_rss_mb >= baseline.cpu_peak_rss_mb + 60
    assert grown.peak_mb == grown.cpu_peak_rss_mb
    peak.reset()
    after = peak.measure()
    if after.cpu_peak_is_per_request:  # the kernel let us reset the high-water mark
        assert after.cpu_peak_rss_mb < grown.cpu_peak_rss_mb - 60
    else:
        assert after.cpu_peak_rss_mb >= grown.cpu_peak_rss_mb


def test_peak_rss_is_positive() -> None:
    assert peak_rss_mb() > 1


def test_peak_is_cuda_allocated_on_a_gpu() -> None:
    usage = MemoryUsage(
        cpu_peak_rss_mb=500.0,
        cpu_peak_is_per_request=True,
        cuda_max_allocated_mb=100.0,
        cuda_max_reserved_mb=128.0,
    )
    assert usage.peak_mb == 100.0
