"""Pipeline inputs end to end: a real node announces the schema, the API validates against it.

A job's scheduler input changes what the ranks compute, as that scheduler would.

Real worker subprocess (tiny, one CPU rank), real Redis, moto S3, a real uvicorn API.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.tasks.api.app import create_app
from kiln.tasks.client.client import KilnClient, ValidationFailed
from kiln.tasks.contract.schemas import JobRequest
from tests.e2e.cluster import Cluster
from tests.tasks.helpers import ThreadServer, api_settings

pytestmark = pytest.mark.timeout(600)

JOB: dict[str, Any] = {
    "pipeline": "tiny",
    "prompt": "a kiln at night",
    "width": 64,
    "height": 64,
    "steps": 4,
    "seed": 11,
    "guidance_scale": 5.0,
}
PIXEL_TOLERANCE = 1  # another process, another thread count: a level out of 255 at most


@pytest.fixture(scope="module")
def cluster(module_cluster_factory: Callable[..., Cluster]) -> Iterator[Cluster]:
    made = module_cluster_factory()
    made.start_worker("tiny", devices="cpu:1")
    yield made
    made.stop_all()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[KilnClient]:
    settings = api_settings(auth_enabled=False)
    with (
        ThreadServer(create_app(settings, cluster.storage_settings)) as server,
        KilnClient(server.url) as api,
    ):
        yield api


def pixels(cluster: Cluster, job_id: str) -> np.ndarray:
    record = cluster.wait_for(job_id, timeout_s=120)
    assert str(record.state) == "succeeded", record.error
    (output,) = record.outputs
    return np.asarray(Image.open(io.BytesIO(cluster.objects.get(output["key"]))).convert("RGB"))


def reference(scheduler: str) -> np.ndarray:
    """The job computed here, in this process, by a tiny pipeline whose scheduler is `scheduler`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipeline = load_pipeline("tiny", torch.device("cpu"), GpuWorkerSettings())
        assert isinstance(pipeline, DiffusersPipeline)
        classes = {c.__name__: c for c in pipeline.pipe.scheduler.compatibles}
        pipeline.pipe.scheduler = classes[scheduler].from_config(pipeline.pipe.scheduler.config)
        request = GenerationRequest(request_id="ref", **JOB)
        ((frames,),) = pipeline.run([request], lambda _step, _total: None)
    finally:
        torch.set_num_threads(threads)
    return np.asarray(frames[0])


def test_the_node_announces_the_schema_and_the_api_serves_it(
    cluster: Cluster, client: KilnClient
) -> None:
    (node,) = cluster.store.live_nodes()
    announced = node["inputs"]["tiny"]
    assert "DDIMScheduler" in announced["properties"]["scheduler"]["enum"]
    info = client.pipeline("tiny")
    assert info.inputs == announced
    assert (info.live_nodes, info.adapters) == (1, [])
    assert info.limits["max_width"] == announced["properties"]["width"]["maximum"] == 1024
    with pytest.raises(ValidationFailed) as refused:
        client.submit(JobRequest(**JOB, inputs={"scheduler": "NoSuchScheduler"}))
    assert list(refused.value.fields) == ["body.inputs.scheduler"]
    with pytest.raises(ValidationFailed) as unknown:
        client.submit(JobRequest(**JOB, inputs={"strength": 0.6}))
    assert list(unknown.value.fields) == ["body.inputs.strength"]


def test_a_scheduler_input_runs_end_to_end_as_that_scheduler(
    cluster: Cluster, client: KilnClient
) -> None:
    default = client.submit(JobRequest(**JOB))
    ddim = client.submit(JobRequest(**JOB, inputs={"scheduler": "DDIMScheduler"}))
    assert ddim.parameters.inputs == {"scheduler": "DDIMScheduler"}
    default_pixels, ddim_pixels = pixels(cluster, default.id), pixels(cluster, ddim.id)
    difference = np.abs(default_pixels.astype(int) - ddim_pixels.astype(int))
    assert difference.max() > 10 * PIXEL_TOLERANCE  # another scheduler, another picture
    expected = reference("DDIMScheduler")
    assert np.abs(expected.astype(int) - ddim_pixels.astype(int)).max() <= PIXEL_TOLERANCE
