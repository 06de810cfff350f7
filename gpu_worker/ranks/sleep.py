"""Sleep and wake on one rank: release the pipelines' memory while the group is idle.

Every rank sleeps when rank 0 relays `SleepGroup`, and wakes when the next `RunBatch` reaches it,
before anything touches a pipeline; both are idempotent, so a rank that missed a batch (rank 0
refused all of it) simply wakes on the next one. Two modes:

- `offload`: each pipeline's modules move to host memory and back. Device memory is given back
  (the CUDA cache emptied too); on CPU ranks nothing moves, so nothing is given back.
- `drop`: the pipelines are deleted, garbage collected, the C heap trimmed (glibc keeps freed
  pages otherwise) and the CUDA cache emptied; waking reloads them from disk as at start
  (parallelised and compiled again; a compiled denoiser then finds its graphs in the cache).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kiln.gpu_worker.inputs import declared_input_schema
from kiln.gpu_worker.pipelines.base import Pipeline
from kiln.gpu_worker.protocol import GroupAsleep, MemoryReading
from kiln.gpu_worker.ranks.start import RankRuntime, load_resident

logger = logging.getLogger(__name__)

SLEEP_MODES = ("offload", "drop")
_MB = 1024 * 1024
_STATUS = Path("/proc/self/status")


def sleep_rank(runtime: RankRuntime, mode: str) -> GroupAsleep:
    """Release this rank's pipelines' memory (`offload` or `drop`); a no-op when asleep."""
    if mode not in SLEEP_MODES:
        raise ValueError(f"sleep mode {mode!r}: expected one of {SLEEP_MODES}")
    started = time.monotonic()
    before = read_memory(runtime.device)
    if runtime.asleep is None:
        if mode == "drop":
            runtime.pipelines.clear()
        else:
            for pipeline in runtime.pipelines.values():
                _move(pipeline, torch.device("cpu"))
        runtime.asleep = mode
        release_memory(runtime.device)
    after = read_memory(runtime.device)
    logger.info("asleep (%s): rss %.0f -> %.0f MiB", mode, before.rss_mb, after.rss_mb)
    return GroupAsleep(mode, before, after, time.monotonic() - started)


def wake_rank(runtime: RankRuntime) -> float:
    """Bring the pipelines back as they were before sleeping; seconds it took (0.0: awake)."""
    mode = runtime.asleep
    if mode is None:
        return 0.0
    started = time.monotonic()
    if mode == "drop":
        load_resident(runtime)
        for pipeline in runtime.pipelines.values():
            declared_input_schema(pipeline)  # derived once per load; rank 0 screens with it next
    else:
        for pipeline in runtime.pipelines.values():
            _move(pipeline, runtime.device)
    runtime.asleep = None
    wake_s = time.monotonic() - started
    logger.info("awake (%s) in %.3f s", mode, wake_s)
    return wake_s


def read_memory(device: torch.device) -> MemoryReading:
    """This process's RSS now, and on CUDA the allocator's allocated and reserved bytes."""
    allocated = reserved = 0.0
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device) / _MB
        reserved = torch.cuda.memory_reserved(device) / _MB
    return MemoryReading(current_rss_mb(), allocated, reserved)


def current_rss_mb() -> float:
    """This process's resident set size now, in MiB (0.0 where /proc is unavailable)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # reported in kB
    except OSError:
        pass
    return 0.0


def release_memory(device: torch.device) -> None:
    """Collect garbage, trim the C heap (Linux glibc), empty the CUDA cache."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # musl and others: no malloc_trim, nothing to trim
            logger.debug("malloc_trim is unavailable here")
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _move(pipeline: Pipeline, device: torch.device) -> None:
    """Move a pipeline's modules: a diffusers pipeline as a whole, else its denoiser."""
    inner: Any = getattr(pipeline, "pipe", None)
    if inner is not None and callable(getattr(inner, "to", None)):
        inner.to(device)
        return
    denoiser = pipeline.denoiser()
    if denoiser is not None:
        denoiser.to(device)
