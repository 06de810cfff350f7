"""Fixture pipelines for end-to-end and crash tests (loaded by ranks as `python:` specs).

`SleepyPipeline` stands in for GPU time: each denoising step sleeps, frames are a deterministic
function of the seed, and every finished request is appended to the file named by
`KILN_TEST_COMPLETIONS` (so tests can count how many times a job really ran to the end).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from kiln.common.limits import DeclaredLimits
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.pipelines.base import StepCallback
from kiln.gpu_worker.protocol import GenerationRequest

STEP_SECONDS_ENV = "KILN_TEST_STEP_SECONDS"
COMPLETIONS_ENV = "KILN_TEST_COMPLETIONS"
POISON_PROMPT = "poison"
FAIL_PROMPT = "fail"  # the pipeline raises: the job fails for good (not retryable)
MAX_STEPS = 300  # what the sleepy pipeline declares: enough for the long jobs of the cancel tests


def frames_for(request: GenerationRequest, index: int) -> np.ndarray:
    """Deterministic frames of one output: a gradient offset by the seed."""
    rng = np.random.default_rng(request.seed + index)
    base = rng.integers(0, 255, size=(1, 1, 1, 3), dtype=np.uint8)
    ramp = np.linspace(0, 255, request.width, dtype=np.uint8)[None, None, :, None]
    frame = (base.astype(np.uint16) + ramp) % 256
    shape = (request.num_frames, request.height, request.width, 3)
    return np.broadcast_to(frame, shape).astype(np.uint8)


class SleepyPipeline:
    """Sleeps `KILN_TEST_STEP_SECONDS` per step (default 0.05); crashes its rank on `poison`."""

    name = "sleepy"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step_seconds = float(os.environ.get(STEP_SECONDS_ENV, "0.05"))
        self.completions = os.environ.get(COMPLETIONS_ENV)

    def supported_fields(self) -> frozenset[str]:
        return frozenset(
            {"prompt", "width", "height", "steps", "seed", "num_frames", "num_outputs"}
        )

    def limits(self) -> DeclaredLimits:
        # Announced by the node: the API and the node refuse what is over them up front.
        return DeclaredLimits(max_width=1024, max_steps=MAX_STEPS)

    def validate(self, request: GenerationRequest) -> None:
        if request.width > 1024:
            raise UnsupportedRequest("width: at most 1024 for the sleepy pipeline")

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        steps = requests[0].steps
        for step in range(1, steps + 1):
            if any(r.prompt == POISON_PROMPT for r in requests):
                os._exit(3)  # a job that kills its rank every time it runs
            if any(r.prompt == FAIL_PROMPT for r in requests):
                raise RuntimeError("the sleepy pipeline was asked to fail")
            time.sleep(self.step_seconds)
            on_step_end(step, steps)
        outputs = [[self.frames(r, i) for i in range(r.num_outputs)] for r in requests]
        self._record(requests)
        return outputs

    def frames(self, request: GenerationRequest, index: int) -> np.ndarray:
        """The frames of one output."""
        return frames_for(request, index)

    def denoiser(self) -> torch.nn.Module | None:
        return None

    def _record(self, requests: Sequence[GenerationRequest]) -> None:
        leader = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if not self.completions or not leader:
            return
        with open(self.completions, "a") as log:
            for request in requests:
                log.write(f"{request.request_id}\n")


def sleepy(device: torch.device) -> SleepyPipeline:
    """`python:tests.e2e.pipelines:sleepy`."""
    return SleepyPipeline(device)


def noise_frames(
    seed: int, index: int, size: tuple[int, int, int], dtype: torch.dtype
) -> np.ndarray:
    """Incompressible frames (F, H, W) computed in `dtype`: other dtypes give other pixels."""
    generator = torch.Generator().manual_seed(seed * 1000 + index)
    values = torch.rand((*size, 3), generator=generator).to(dtype).to(torch.float32)
    return (values * 255).to(torch.uint8).numpy()


class DtypeNoisePipeline(SleepyPipeline):
    """The sleepy pipeline with noise frames computed in the node's `KILN_TORCH_DTYPE`.

    Noise makes encoding take a while (a 768x768 PNG: ~0.2 s), and two nodes of other dtypes
    write other bytes for the same job, as GPUs do.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from kiln.gpu_worker.settings import GpuWorkerSettings

        name = GpuWorkerSettings().torch_dtype
        self.dtype = torch.float32 if name == "auto" else getattr(torch, name)

    def frames(self, request: GenerationRequest, index: int) -> np.ndarray:
        size = (request.num_frames, request.height, request.width)
        return noise_frames(request.seed, index, size, self.dtype)


def dtype_noise(device: torch.device) -> DtypeNoisePipeline:
    """`python:tests.e2e.pipelines:dtype_noise`."""
    return DtypeNoisePipeline(device)
