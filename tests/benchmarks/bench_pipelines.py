"""Fixture pipelines of bench_node.py: `busy` (busy ratio) and `tiny` (threads pinned, recorded).

`BusyPipeline` stands in for GPU time: it sleeps `KILN_BENCH_SLEEP_S` (default 0.2 s) PER REQUEST
of a batch, so batching cannot make the group look busier than it is, and returns image-like
frames (smooth colour fields plus mild noise, like a decoded latent) whose PNG costs about what a
real image of that size costs. Every forward appends `start end requests` (epoch seconds) to the
file named by `KILN_BENCH_FORWARDS`, from rank 0 only (or from the one process that runs it
in-process, as the hand-written baseline does), so the group's busy time can be summed.
`tiny` is gpu_worker's tiny pipeline with the same recording and a fixed torch thread count.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from kiln.gpu_worker.pipelines import Pipeline, load_pipeline
from kiln.gpu_worker.pipelines.base import StepCallback
from kiln.gpu_worker.protocol import GenerationRequest

SLEEP_ENV = "KILN_BENCH_SLEEP_S"
FORWARDS_ENV = "KILN_BENCH_FORWARDS"
THREADS_ENV = "KILN_BENCH_TORCH_THREADS"


def image_like(width: int, height: int, seed: int) -> np.ndarray:
    """A (1, H, W, 3) uint8 image: a bilinear upsample of a coarse random grid plus noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(9, 9, 3))
    ys = np.linspace(0, 8, height)[:, None]
    xs = np.linspace(0, 8, width)[None, :]
    y0, x0 = np.minimum(ys.astype(int), 7), np.minimum(xs.astype(int), 7)
    fy, fx = (ys - y0)[..., None], (xs - x0)[..., None]
    top = coarse[y0, x0] * (1 - fx) + coarse[y0, x0 + 1] * fx
    bottom = coarse[y0 + 1, x0] * (1 - fx) + coarse[y0 + 1, x0 + 1] * fx
    smooth = top * (1 - fy) + bottom * fy
    noisy = smooth + rng.normal(0, 3.0, size=smooth.shape)
    clipped: np.ndarray = np.clip(noisy, 0, 255)
    return clipped.astype(np.uint8)[None]


def record_forward(path: str | None, started: float, ended: float, count: int) -> None:
    """Append `start end requests` to `path`, from rank 0 (or a process with no group) only."""
    dist = torch.distributed
    if not path or (dist.is_initialized() and dist.get_rank() != 0):
        return
    with open(path, "a") as log:
        log.write(f"{started:.6f} {ended:.6f} {count}\n")


class BusyPipeline:
    """Sleeps a fixed time per request; records each forward's (start, end) on rank 0."""

    name = "busy"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sleep_s = float(os.environ.get(SLEEP_ENV, "0.2"))
        self.forwards = os.environ.get(FORWARDS_ENV)
        self._images: dict[tuple[int, int], list[np.ndarray]] = {}

    def supported_fields(self) -> frozenset[str]:
        """Fields this pipeline honours."""
        return frozenset({"prompt", "width", "height", "steps", "seed", "num_outputs"})

    def validate(self, request: GenerationRequest) -> None:
        """Every image request is fine."""

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        """Sleep `sleep_s` per request (split across the steps), then hand back the frames."""
        for request in requests:  # the frame bank is made before the clock starts
            self._bank(request.width, request.height)
        started = time.time()
        steps = requests[0].steps
        per_step = self.sleep_s * sum(r.num_outputs for r in requests) / steps
        for step in range(1, steps + 1):
            time.sleep(per_step)
            on_step_end(step, steps)
        outputs = [
            [self._image(r.width, r.height, r.seed + i) for i in range(r.num_outputs)]
            for r in requests
        ]
        record_forward(self.forwards, started, time.time(), len(requests))
        return outputs

    def denoiser(self) -> torch.nn.Module | None:
        """No module to parallelise."""
        return None

    def _bank(self, width: int, height: int) -> list[np.ndarray]:
        # Made once per size, then picked by seed: the forward is the sleep, not numpy.
        bank = self._images.get((width, height))
        if bank is None:
            bank = [image_like(width, height, s) for s in range(8)]
            self._images[(width, height)] = bank
        return bank

    def _image(self, width: int, height: int, seed: int) -> np.ndarray:
        bank = self._bank(width, height)
        return bank[seed % len(bank)]


def busy(device: torch.device) -> BusyPipeline:
    """`python:tests.benchmarks.bench_pipelines:busy`."""
    return BusyPipeline(device)


class Recorded:
    """Any pipeline, with each forward's (start, end) recorded like `BusyPipeline` does."""

    def __init__(self, inner: Pipeline) -> None:
        self.inner = inner
        self.name = inner.name
        self.forwards = os.environ.get(FORWARDS_ENV)

    def supported_fields(self) -> frozenset[str]:
        """The inner pipeline's fields."""
        return self.inner.supported_fields()

    def validate(self, request: GenerationRequest) -> None:
        """The inner pipeline's check."""
        self.inner.validate(request)

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        """Run the inner pipeline and record the forward."""
        started = time.time()
        outputs = self.inner.run(requests, on_step_end)
        record_forward(self.forwards, started, time.time(), len(requests))
        return outputs

    def denoiser(self) -> torch.nn.Module | None:
        """The inner pipeline's denoiser."""
        return self.inner.denoiser()


def tiny(device: torch.device) -> Pipeline:
    """`python:tests.benchmarks.bench_pipelines:tiny`: the `tiny` pipeline, threads pinned.

    On a shared 2-core machine two OpenMP threads per process are pathological (measured: a
    64x64 image took 1.5-12.7 s instead of ~0.15-0.25 s with one thread, and `kiln worker` gives
    a CPU rank `cores / ranks` threads unless KILN_CPU_THREADS_PER_RANK says otherwise). Loading
    through this factory sets `KILN_BENCH_TORCH_THREADS` threads in whichever process loads it,
    so Kiln's rank, the baseline and the direct path all compute with the same count; each
    forward is recorded like `BusyPipeline`'s.
    """
    threads = os.environ.get(THREADS_ENV)
    if threads:
        torch.set_num_threads(int(threads))
    return Recorded(load_pipeline("tiny", device))
