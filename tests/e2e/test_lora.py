"""Per-request LoRA end to end: a real node with `--lora-dir`, the API validating `loras`.

Two jobs with different adapters submitted together each get their own picture, equal to the
one that adapter makes alone; the node's small adapter cache (2) unloads the least recently
used adapter, and the heartbeat and GET /v1/pipelines/{name} show it. An adapter no live node
offers is a 422 naming `loras[i].name`.

Real worker subprocess (tiny, two CPU ranks dividing each forward), real Redis, moto S3, a real
uvicorn API.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.tasks.client.client import KilnClient, ValidationFailed
from kiln.tasks.contract.loras import LoraSpec
from kiln.tasks.contract.schemas import JobRequest
from tests.e2e.cluster import Cluster
from tests.e2e.tiny_jobs import PIXEL_TOLERANCE, TINY_JOB, computed_here, stored_pixels
from tests.gpu_worker.tiny_lora import build_tiny_lora
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

ADAPTERS = {"ember": 1, "frost": 2, "smoke": 3}  # name -> seed of its random weights


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from the tiny model the worker loads (its weights come from a fixed seed).
    folder = tmp_path_factory.mktemp("loras")
    base = load_pipeline("tiny", torch.device("cpu"), GpuWorkerSettings())
    assert isinstance(base, DiffusersPipeline)
    for name, seed in ADAPTERS.items():
        build_tiny_lora(base.pipe.unet, folder / "tiny" / name, seed)
    return folder


@pytest.fixture(scope="module")
def cluster(module_cluster_factory: Callable[..., Cluster], lora_dir: Path) -> Cluster:
    made = module_cluster_factory()
    # Two ranks splitting each forward's rows: a rank without the batch's adapters would compute
    # its half of the picture without them.
    made.start_worker(
        "tiny",
        devices="cpu:2",
        extra_env={"KILN_LORA_CACHE_COUNT": "2"},
        extra_args=["--lora-dir", str(lora_dir), "--parallel", "batch", "--batch-window-ms", "300"],
    )
    return made


def alone(lora_dir: Path, name: str, scale: float) -> np.ndarray:
    """The job with this one adapter, computed here by a pipeline that ran nothing else."""
    request = GenerationRequest(request_id="ref", **TINY_JOB, loras=(AdapterRef(name, scale),))
    return computed_here(request, GpuWorkerSettings(lora_dir=lora_dir))


def held(cluster: Cluster, client: KilnClient) -> tuple[list[str], list[str]]:
    """Adapters loaded on the node: as its heartbeat says, and as GET /v1/pipelines/tiny says."""
    (node,) = cluster.store.live_nodes()
    listed = client.pipeline("tiny").adapters
    return node["adapters"]["tiny"]["loaded"], [a.name for a in listed if a.loaded_on]


def job(*loras: LoraSpec) -> JobRequest:
    return JobRequest(**TINY_JOB, loras=list(loras))


def test_an_adapter_no_node_offers_is_a_422_naming_it(cluster: Cluster, client: KilnClient) -> None:
    (node,) = cluster.store.live_nodes()
    assert node["adapters"]["tiny"]["available"] == sorted(ADAPTERS)
    info = client.pipeline("tiny")
    assert [a.name for a in info.adapters] == sorted(ADAPTERS)
    assert info.adapters[0].available_on == [node["node_id"]]
    with pytest.raises(ValidationFailed) as refused:
        client.submit(job(LoraSpec(name="ember"), LoraSpec(name="nope")))
    assert list(refused.value.fields) == ["body.loras.1.name"]


def test_two_jobs_with_different_adapters_each_get_their_own_picture(
    cluster: Cluster, client: KilnClient, lora_dir: Path
) -> None:
    ember = client.submit(job(LoraSpec(name="ember", scale=0.8)))
    frost = client.submit(job(LoraSpec(name="frost", scale=0.8)))
    assert ember.parameters.loras[0].name == "ember"
    ember_pixels, frost_pixels = stored_pixels(cluster, ember.id), stored_pixels(cluster, frost.id)
    assert np.abs(ember_pixels - frost_pixels).max() > 10 * PIXEL_TOLERANCE
    assert np.abs(ember_pixels - alone(lora_dir, "ember", 0.8)).max() <= PIXEL_TOLERANCE
    assert np.abs(frost_pixels - alone(lora_dir, "frost", 0.8)).max() <= PIXEL_TOLERANCE
    # A third adapter on a cache of two: the least recently used one is unloaded. The two jobs
    # ran one after the other in either order (one batch each); the one that ended last stays.
    ember_end = cluster.store.get(ember.id).finished_at or 0.0
    frost_end = cluster.store.get(frost.id).finished_at or 0.0
    last = "ember" if ember_end > frost_end else "frost"
    stored_pixels(cluster, client.submit(job(LoraSpec(name="smoke"))).id)
    expected = (sorted([last, "smoke"]), sorted([last, "smoke"]))
    wait_until(lambda: held(cluster, client), lambda seen: seen == expected)
