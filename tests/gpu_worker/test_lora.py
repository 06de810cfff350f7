"""Per-request LoRA on the tiny pipeline: adapters built offline with peft, loaded per request.

Scale 0 is the base model; scale s is the model with s times the adapter folded into its weights
by hand; a hot adapter set fused into the weights computes what the unfused one did; the per-rank
cache unloads the least recently used adapters past its count and byte limits.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch

from kiln.gpu_worker.batching import plan_batch
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.pipelines.lora import (
    AdapterCache,
    AdapterLimits,
    adapter_state,
)
from kiln.gpu_worker.pipelines.lora_folders import available_adapters
from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.tiny_lora import build_tiny_lora, fuse_by_hand

CPU = torch.device("cpu")
ADAPTERS = {"one": 1, "two": 2, "three": 3}  # name -> seed of its random weights
ONE_LEVEL = 1  # 1/255: the most a uint8 pixel may differ from the hand-fused reference


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Shared cores: one thread keeps a tiny forward steady (see test_pipelines.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> GpuWorkerSettings:
    models = tmp_path_factory.mktemp("models")
    loras = tmp_path_factory.mktemp("loras")
    base = load_pipeline("tiny", CPU, GpuWorkerSettings(model_cache=models))
    assert isinstance(base, DiffusersPipeline)
    for name, seed in ADAPTERS.items():
        build_tiny_lora(base.pipe.unet, loras / "tiny" / name, seed)
    return GpuWorkerSettings(model_cache=models, lora_dir=loras)


def fresh(settings: GpuWorkerSettings, **limits: int) -> DiffusersPipeline:
    """A newly loaded tiny pipeline (no adapter in it yet) whose cache has these limits."""
    pipeline = load_pipeline("tiny", CPU, settings)
    assert isinstance(pipeline, DiffusersPipeline)
    if limits:
        pipeline.adapters = AdapterCache(pipeline.pipe, settings.lora_dir, AdapterLimits(**limits))
    return pipeline


def request(*loras: tuple[str, float], request_id: str = "r") -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id, pipeline="tiny", prompt="a kiln at dusk", width=64, height=64,
        steps=2, seed=5, guidance_scale=5.0,
        loras=tuple(AdapterRef(name, scale) for name, scale in loras),
    )  # fmt: skip


def pixels(pipeline: DiffusersPipeline, job: GenerationRequest) -> np.ndarray:
    pipeline.validate(job)
    ((frames,),) = pipeline.run([job], lambda _step, _total: None)
    return frames.astype(np.int16)


def weights(settings: GpuWorkerSettings, name: str) -> Path:
    assert settings.lora_dir is not None
    return settings.lora_dir / "tiny" / name / "pytorch_lora_weights.safetensors"


def activate(pipeline: DiffusersPipeline, job: GenerationRequest) -> None:
    """What a forward does to the cache, without the forward."""
    pipeline.validate(job)
    with pipeline.adapters.applied(job):
        pass


@dataclass(frozen=True)
class Loaded:
    """What the cache says it holds, and what the pipeline itself holds."""

    cache: tuple[str, ...]
    pipe: set[str]


def loaded(pipeline: DiffusersPipeline) -> Loaded:
    state = adapter_state(pipeline)
    assert state is not None
    held = pipeline.pipe.get_list_adapters()  # per component, the adapters PEFT holds
    return Loaded(state.loaded, {name for names in held.values() for name in names})


def test_scale_zero_is_the_base_model(settings: GpuWorkerSettings) -> None:
    pipeline = fresh(settings)
    base = pixels(pipeline, request())
    assert np.array_equal(pixels(pipeline, request(("one", 0.0))), base)
    pixels(pipeline, request(("one", 1.0)))
    # A request without adapters after one with: the adapter is switched off, not left on.
    assert np.array_equal(pixels(pipeline, request()), base)


def test_scale_s_is_the_adapters_fused_by_hand(settings: GpuWorkerSettings) -> None:
    served = fresh(settings)
    reference = fresh(settings)
    base = pixels(reference, request())
    fuse_by_hand(reference.pipe.unet, weights(settings, "one"), 0.7)
    by_hand = pixels(reference, request())
    assert np.abs(by_hand - base).max() > 10 * ONE_LEVEL  # the adapter does change the pixels
    assert np.abs(pixels(served, request(("one", 0.7))) - by_hand).max() <= ONE_LEVEL
    # Two adapters add up, each at its own scale.
    fuse_by_hand(reference.pipe.unet, weights(settings, "two"), -0.8)
    both = pixels(served, request(("one", 0.7), ("two", -0.8)))
    assert np.abs(both - pixels(reference, request())).max() <= ONE_LEVEL


def test_a_hot_set_is_fused_and_unfused_when_another_comes(settings: GpuWorkerSettings) -> None:
    pipeline = fresh(settings, fuse_after=2)
    base = pixels(pipeline, request())
    hot = request(("one", 0.7))
    unfused = [pixels(pipeline, hot) for _ in range(2)]  # fused after the second batch
    state = adapter_state(pipeline)
    assert state is not None
    assert state.fused == ("one",)
    fused = pixels(pipeline, hot)
    assert np.array_equal(unfused[0], unfused[1])
    assert np.abs(fused - unfused[0]).max() <= ONE_LEVEL
    pixels(pipeline, request(("two", 1.0)))  # unfuses "one" first
    assert np.array_equal(pixels(pipeline, request()), base)
    after = adapter_state(pipeline)
    assert after is not None
    assert after.fused == ()


def test_unfusing_in_bfloat16_restores_the_exact_base_weights(settings: GpuWorkerSettings) -> None:
    # bf16 rounds W + d - d away from W: the base weights are restored, not recomputed.
    pipeline = fresh(settings.model_copy(update={"torch_dtype": "bfloat16"}), fuse_after=1)
    unet = pipeline.pipe.unet
    before = {name: p.detach().clone() for name, p in unet.named_parameters()}
    for name in ("one", "two", "one", "two"):  # each fused after its batch, unfused by the next
        activate(pipeline, request((name, 1.5)))
    activate(pipeline, request())
    after = {
        n.replace(".base_layer", ""): p for n, p in unet.named_parameters() if "lora_" not in n
    }
    assert after.keys() == before.keys()
    changed = [name for name, p in before.items() if not torch.equal(p, after[name])]
    assert changed == []


def test_the_cache_unloads_the_least_recently_used_past_its_count(
    settings: GpuWorkerSettings,
) -> None:
    pipeline = fresh(settings, count=2)
    for name in ("one", "two", "one", "three"):  # "one" used again: "two" is the oldest
        activate(pipeline, request((name, 1.0)))
    assert loaded(pipeline) == Loaded(("one", "three"), {"one", "three"})


def test_the_cache_unloads_the_least_recently_used_past_its_bytes(
    settings: GpuWorkerSettings,
) -> None:
    size = weights(settings, "one").stat().st_size
    pipeline = fresh(settings, count=8, max_bytes=size * 5 // 2)  # room for two
    for name in ("two", "one", "two", "three"):
        activate(pipeline, request((name, 1.0)))
    assert loaded(pipeline) == Loaded(("two", "three"), {"two", "three"})
    state = adapter_state(pipeline)
    assert state is not None
    assert state.loaded_bytes <= size * 5 // 2
    # A request needing more than the cache holds is refused, not half-applied.
    small = fresh(settings, count=1)
    with pytest.raises(UnsupportedRequest, match="loras: 2 adapters"):
        small.validate(request(("one", 1.0), ("two", 1.0)))


def test_an_unknown_adapter_is_refused_naming_it(settings: GpuWorkerSettings) -> None:
    pipeline = fresh(settings)
    with pytest.raises(UnsupportedRequest, match=r"loras\[1\]\.name: no adapter 'nope'"):
        pipeline.validate(request(("one", 1.0), ("nope", 1.0)))
    assert available_adapters(settings.lora_dir, "tiny") == sorted(ADAPTERS)
    assert available_adapters(settings.lora_dir, "tiny-video") == []
    # Without a lora dir a rank still looks among the adapters its node fetched from the store.
    without = load_pipeline("tiny", CPU, GpuWorkerSettings(model_cache=settings.model_cache))
    with pytest.raises(UnsupportedRequest, match=r"no adapter 'one' for tiny; available: \[\]"):
        without.validate(request(("one", 1.0)))


def test_requests_batch_only_with_equal_adapters() -> None:
    @dataclass(frozen=True)
    class Item:
        request: GenerationRequest
        enqueued_at: float = 0.0

    queue = [
        Item(request(("one", 1.0), request_id="a")),
        Item(request(("two", 1.0), request_id="b")),
        Item(request(("one", 0.5), request_id="c")),
        Item(request(("one", 1.0), request_id="d")),
        Item(request(request_id="e")),
    ]
    batch = plan_batch(queue, max_batch=8)
    assert [item.request.request_id for item in batch] == ["a", "d"]
