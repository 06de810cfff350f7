"""LoRA adapters kept in the object store: listed for the heartbeat, fetched on first use.

Real moto S3 (server mode) and the real local store; a tiny random adapter built offline with
peft. An adapter that exists only in the store, fetched by the node's `AdapterSources` and loaded
by a rank's pipeline, makes the same pixels as the same file served from `--lora-dir`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch

from kiln.gpu_worker.errors import JobFailed
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.pipelines.lora_folders import ADAPTER_WEIGHTS, store_adapter_cache
from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.storage.errors import ObjectStoreError
from kiln.storage.local_store import LocalObjectStore
from kiln.storage.object_base import SHA256_METADATA_KEY, ObjectStore
from kiln.storage.s3_store import S3ObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.node.adapters import (
    AdapterSources,
    StoreAdapters,
    store_adapter_folder,
)
from tests.gpu_worker.tiny_lora import build_tiny_lora

CPU = torch.device("cpu")
PREFIX = "loras"


class Clock:
    """A clock the test moves by hand (the listing interval, without waiting)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def s3(s3_settings: StorageSettings) -> S3ObjectStore:
    return S3ObjectStore.from_settings(s3_settings)  # prefix "outputs"


def put_adapter(objects: ObjectStore, name: str, data: bytes, pipeline: str = "tiny") -> str:
    key = f"{store_adapter_folder(objects, PREFIX, pipeline)}/{name}/{ADAPTER_WEIGHTS}"
    objects.put(key, data, "application/octet-stream")
    return key


def fetch(sources: AdapterSources, *names: str) -> None:
    refs = tuple(AdapterRef(name, 1.0) for name in names)
    job = GenerationRequest("r", "tiny", "p", 64, 64, 1, 0, guidance_scale=5.0, loras=refs)
    sources.fetch(job)


def test_the_store_offers_adapter_folders_with_names_a_job_can_give(s3: S3ObjectStore) -> None:
    for name in ("ember", "frost", "a.b"):  # a dot would split PEFT module paths: never offered
        put_adapter(s3, name, b"w")
    folder = store_adapter_folder(s3, PREFIX, "tiny")
    s3.put(f"{folder}/notes/readme.txt", b"not an adapter", "text/plain")
    s3.put(f"{folder}/deep/x/{ADAPTER_WEIGHTS}", b"too deep", "application/octet-stream")
    put_adapter(s3, "smoke", b"w", pipeline="tiny-video")
    store = StoreAdapters(s3, PREFIX, Path("/unused"))
    assert folder == "outputs/loras/tiny"  # under the storage URL's prefix
    assert store.names("tiny") == ["ember", "frost"]
    assert store.names("tiny-video") == ["smoke"]
    assert store.names("tiny-img2img") == []


def test_the_listing_is_refreshed_after_its_interval_only(tmp_path: Path) -> None:
    objects = LocalObjectStore(tmp_path / "store")
    clock = Clock()
    store = StoreAdapters(objects, PREFIX, tmp_path / "cache", list_interval_s=30, clock=clock)
    put_adapter(objects, "ember", b"w")
    assert store.names("tiny") == ["ember"]
    put_adapter(objects, "frost", b"w")
    clock.now = 29.0
    assert store.names("tiny") == ["ember"]  # one LIST per interval, not per heartbeat
    clock.now = 30.0
    assert store.names("tiny") == ["ember", "frost"]


def test_a_failed_listing_keeps_what_was_listed(s3: S3ObjectStore, tmp_path: Path) -> None:
    put_adapter(s3, "ember", b"w")
    store = StoreAdapters(s3, PREFIX, tmp_path, list_interval_s=0)
    assert store.names("tiny") == ["ember"]
    s3.delete(f"{store_adapter_folder(s3, PREFIX, 'tiny')}/ember/{ADAPTER_WEIGHTS}")
    s3.client.delete_bucket(Bucket=s3.bucket)  # every LIST now fails
    assert store.names("tiny") == ["ember"]


def test_an_adapter_is_fetched_once_checked_and_whole(s3: S3ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(50_000)
    key = put_adapter(s3, "ember", data)
    sources = AdapterSources(None, StoreAdapters(s3, PREFIX, tmp_path / "cache"))
    fetch(sources, "ember", "nope")  # an adapter the store lacks is left to the ranks to refuse
    cached = tmp_path / "cache" / "tiny" / "ember" / ADAPTER_WEIGHTS
    assert cached.read_bytes() == data
    assert sorted(p.name for p in cached.parent.iterdir()) == [ADAPTER_WEIGHTS]  # no temp file
    assert not (tmp_path / "cache" / "tiny" / "nope").exists()
    s3.delete(key)  # fetched once: later jobs do not go back to the store
    fetch(sources, "ember")
    assert cached.read_bytes() == data


def test_an_object_that_does_not_match_its_sha256_is_not_kept(
    s3: S3ObjectStore, tmp_path: Path
) -> None:
    # S3: the store's own read check refuses it; a local store's file changed behind its
    # sidecar: the node's check does. Either way the job fails for good, and nothing stays.
    local = LocalObjectStore(tmp_path / "store")
    key = put_adapter(local, "ember", b"weights")
    (tmp_path / "store" / key).write_bytes(b"tampered")
    s3_key = f"{store_adapter_folder(s3, PREFIX, 'tiny')}/ember/{ADAPTER_WEIGHTS}"
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    s3.client.put_object(
        Bucket=s3.bucket, Key=s3_key, Body=b"weights", Metadata={SHA256_METADATA_KEY: wrong}
    )
    refusals: list[tuple[ObjectStore, type[JobFailed | ObjectStoreError]]] = [
        (local, JobFailed),
        (s3, ObjectStoreError),
    ]
    for objects, refusal in refusals:
        cache = tmp_path / f"cache-{type(objects).__name__}"
        sources = AdapterSources(None, StoreAdapters(objects, PREFIX, cache))
        with pytest.raises(refusal, match="sha256") as refused:
            fetch(sources, "ember")
        error = refused.value
        assert isinstance(error, JobFailed | ObjectStoreError)
        assert not error.retryable  # another attempt would read the same bad object
        assert list(cache.rglob("*")) in ([], [cache / "tiny", cache / "tiny" / "ember"])


def test_the_local_folder_wins_and_both_sources_are_announced(
    s3: S3ObjectStore, tmp_path: Path
) -> None:
    local = tmp_path / "lora-dir" / "tiny"
    for name in ("ember", "glow"):
        (local / name).mkdir(parents=True)
        (local / name / ADAPTER_WEIGHTS).write_bytes(b"local")
    put_adapter(s3, "ember", b"store")
    put_adapter(s3, "frost", b"store")
    cache = tmp_path / "cache"
    sources = AdapterSources(tmp_path / "lora-dir", StoreAdapters(s3, PREFIX, cache))
    fetch(sources, "ember", "glow", "frost")
    assert sorted(p.name for p in (cache / "tiny").iterdir()) == ["frost"]
    stats = {"adapters": {"tiny": {"loaded": ["frost"], "fused": []}}}
    assert sources.heartbeat(["tiny"], stats) == {
        "tiny": {"available": ["ember", "frost", "glow"], "loaded": ["frost"], "fused": []}
    }


def test_the_settings_name_the_store_and_the_cache(
    s3: S3ObjectStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gpu = GpuWorkerSettings(model_cache=tmp_path / "models")
    assert AdapterSources.for_node(gpu, s3).store is None
    monkeypatch.setenv("KILN_LORA_PREFIX", "/loras/")
    sources = AdapterSources.for_node(GpuWorkerSettings(model_cache=tmp_path / "models"), s3)
    assert sources.store is not None
    put_adapter(s3, "ember", b"w")
    fetch(sources, "ember")
    assert (store_adapter_cache(gpu) / "tiny" / "ember" / ADAPTER_WEIGHTS).read_bytes() == b"w"
    with pytest.raises(ValueError, match="prefix"):
        AdapterSources.for_node(GpuWorkerSettings(lora_prefix="../up"), s3)


# --- the ranks load a fetched adapter as they load a local one --------------------------------


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: one thread keeps a tiny forward steady
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_an_adapter_only_in_the_store_makes_the_pixels_of_the_lora_dir_one(
    s3: S3ObjectStore, tmp_path: Path
) -> None:
    models, lora_dir = tmp_path / "models", tmp_path / "lora-dir"
    base = load_pipeline("tiny", CPU, GpuWorkerSettings(model_cache=models))
    assert isinstance(base, DiffusersPipeline)
    weights = build_tiny_lora(base.pipe.unet, lora_dir / "tiny" / "ember", seed=1)
    put_adapter(s3, "ember", weights.read_bytes())
    job = GenerationRequest(
        request_id="r", pipeline="tiny", prompt="a kiln at dusk", width=64, height=64, steps=2,
        seed=5, guidance_scale=5.0, loras=(AdapterRef("ember", 0.8),),
    )  # fmt: skip

    def pixels(settings: GpuWorkerSettings, request: GenerationRequest) -> np.ndarray:
        pipeline = load_pipeline("tiny", CPU, settings)
        pipeline.validate(request)
        ((frames,),) = pipeline.run([request], lambda _step, _total: None)
        return np.asarray(frames).astype(np.int16)

    # From the lora dir first, while the node's cache is still empty.
    from_dir = pixels(GpuWorkerSettings(model_cache=models, lora_dir=lora_dir), job)
    store_only = GpuWorkerSettings(model_cache=models)  # no lora dir at all
    sources = AdapterSources.for_node(store_only.model_copy(update={"lora_prefix": PREFIX}), s3)
    assert sources.available("tiny") == ["ember"]
    sources.fetch(job)
    from_store = pixels(store_only, job)
    plain = pixels(store_only, dataclasses.replace(job, loras=()))
    assert np.array_equal(from_store, from_dir)
    assert np.abs(from_store - plain).max() > 10  # the adapter did apply
