"""LoRA adapters from the object store, end to end: a real node with `KILN_LORA_PREFIX`.

The node announces the adapters of its `--lora-dir` and of the store; a job naming one that is
only in the store gets it fetched on first use into the node's cache, and makes the same picture
as a job naming the same weights from the lora dir.

Real worker subprocess (tiny, one CPU rank), real Redis, moto S3 (server mode), real uvicorn API.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.pipelines.lora_folders import ADAPTER_WEIGHTS, STORE_CACHE_FOLDER
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.loras import LoraSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.adapters import store_adapter_folder
from tests.e2e.cluster import Cluster
from tests.e2e.tiny_jobs import PIXEL_TOLERANCE, TINY_JOB, stored_pixels
from tests.gpu_worker.tiny_lora import build_tiny_lora

pytestmark = pytest.mark.timeout(600)

PREFIX = "loras"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The node's lora dir (adapter `ember`) and its own model cache (no fetched adapter yet)."""
    lora_dir, models = tmp_path_factory.mktemp("loras"), tmp_path_factory.mktemp("models")
    base = load_pipeline("tiny", torch.device("cpu"), GpuWorkerSettings(model_cache=models))
    assert isinstance(base, DiffusersPipeline)
    build_tiny_lora(base.pipe.unet, lora_dir / "tiny" / "ember", seed=1)
    return lora_dir, models


@pytest.fixture(scope="module")
def cluster(
    module_cluster_factory: Callable[..., Cluster], folders: tuple[Path, Path]
) -> Iterator[Cluster]:
    lora_dir, models = folders
    made = module_cluster_factory()
    # The store holds the same weights as `ember-copy`, which the lora dir lacks.
    key = f"{store_adapter_folder(made.objects, PREFIX, 'tiny')}/ember-copy/{ADAPTER_WEIGHTS}"
    weights = (lora_dir / "tiny" / "ember" / ADAPTER_WEIGHTS).read_bytes()
    made.objects.put(key, weights, "application/octet-stream")
    made.start_worker(
        "tiny",
        extra_env={"KILN_LORA_PREFIX": PREFIX, "KILN_MODEL_CACHE": str(models)},
        extra_args=["--lora-dir", str(lora_dir)],
    )
    yield made
    made.stop_all()
    shutil.rmtree(models / STORE_CACHE_FOLDER, ignore_errors=True)


def test_an_adapter_only_in_the_store_makes_the_lora_dir_ones_picture(
    cluster: Cluster, client: KilnClient, folders: tuple[Path, Path]
) -> None:
    _, models = folders
    (node,) = cluster.store.live_nodes()
    assert node["adapters"]["tiny"]["available"] == ["ember", "ember-copy"]
    assert [a.name for a in client.pipeline("tiny").adapters] == ["ember", "ember-copy"]
    fetched = models / STORE_CACHE_FOLDER / "tiny" / "ember-copy" / ADAPTER_WEIGHTS
    assert not fetched.exists()  # first use fetches it, not the start
    jobs = [
        JobRequest(**TINY_JOB, loras=[LoraSpec(name="ember-copy", scale=0.8)]),  # from the store
        JobRequest(**TINY_JOB, loras=[LoraSpec(name="ember", scale=0.8)]),  # from the lora dir
        JobRequest(**TINY_JOB),  # plain
    ]
    submitted = [client.submit(job).id for job in jobs]
    store_pixels, dir_pixels, plain_pixels = (stored_pixels(cluster, j) for j in submitted)
    assert np.abs(store_pixels - dir_pixels).max() <= PIXEL_TOLERANCE
    assert np.abs(store_pixels - plain_pixels).max() > 10 * PIXEL_TOLERANCE
    assert fetched.is_file()
