"""Jobs of the tiny pipeline end to end: a request, its picture as stored, the same job run here.

Shared by the tests that compare what a real node made with what an in-process pipeline makes
for the same request (LoRA adapters from a folder or the object store, scheduler inputs).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.e2e.cluster import Cluster

TINY_JOB: dict[str, Any] = {
    "pipeline": "tiny",
    "prompt": "a kiln at night",
    "width": 64,
    "height": 64,
    "steps": 3,
    "seed": 11,
    "guidance_scale": 5.0,
}
PIXEL_TOLERANCE = 1  # another process, another thread count: a level out of 255 at most


def stored_pixels(cluster: Cluster, job_id: str) -> np.ndarray:
    """The job's one output image, once it succeeded, as int16 RGB (differences stay signed)."""
    record = cluster.wait_for(job_id, timeout_s=120)
    assert str(record.state) == "succeeded", record.error
    (output,) = record.outputs
    image = Image.open(io.BytesIO(cluster.objects.get(output["key"]))).convert("RGB")
    return np.asarray(image).astype(np.int16)


def computed_here(
    request: GenerationRequest,
    settings: GpuWorkerSettings | None = None,
    prepare: Callable[[DiffusersPipeline], None] = lambda _pipeline: None,
) -> np.ndarray:
    """`request` run in this process by a fresh tiny pipeline (`prepare`d first), as int16 RGB."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a node's rank runs: the same kernels, the same rounding
    try:
        pipeline = load_pipeline("tiny", torch.device("cpu"), settings or GpuWorkerSettings())
        assert isinstance(pipeline, DiffusersPipeline)
        prepare(pipeline)
        ((frames,),) = pipeline.run([request], lambda _step, _total: None)
    finally:
        torch.set_num_threads(threads)
    return np.asarray(frames[0]).astype(np.int16)
