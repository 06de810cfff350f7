"""Speed modes on the ranks: the block cache around one forward, its report, and what refuses it.

`tiny-dit` (a Flux-style DiT) takes diffusers' First Block Cache; `tiny` (a UNet) does not, so it
serves `exact` only and refuses the others by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch

from kiln.common.request import SPEED_KEY, SPEED_MODES
from kiln.gpu_worker.batching import plan_batch
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.errors import JobFailed, UnsupportedRequest
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.gpu_worker.speed import declared_refusal, lower_precision
from tests.gpu_worker.conftest import GENEROUS_S

CPU = torch.device("cpu")
STEPS = 8
# The T5 encoder's default 512 tokens make the tiny DiT's attention 32x longer than its image.
SHORT_TEXT = {"max_sequence_length": 32}
# Measured with these requests (8 steps, 64x64, seed 7): `fast` differs from `exact` by at most
# 4 of 255 and 0.29 on average; another seed differs by 255 at most and 40 on average. The bounds
# leave 4x / 7x margin for other torch builds, and stay 20x below what another seed changes.
FAST_MAX_DIFF = 16
FAST_MEAN_DIFF = 2.0


def dit_request(**overrides: object) -> GenerationRequest:
    base = GenerationRequest(
        request_id="r",
        pipeline="tiny-dit",
        prompt="a red cat",
        width=64,
        height=64,
        steps=STEPS,
        seed=7,
        guidance_scale=5.0,
        extra_inputs=SHORT_TEXT,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def no_progress(step: int, total: int) -> None:
    """A step callback that ignores the steps."""


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Shared cores: one thread keeps a tiny forward steady (see test_pipelines.py).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> GpuWorkerSettings:
    return GpuWorkerSettings(model_cache=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def dit(settings: GpuWorkerSettings) -> DiffusersPipeline:
    pipeline = load_pipeline("tiny-dit", CPU, settings)
    assert isinstance(pipeline, DiffusersPipeline)
    return pipeline


@pytest.fixture(scope="module")
def exact(dit: DiffusersPipeline) -> np.ndarray:
    """The tiny DiT's output before any speed mode ever ran on it."""
    return dit.run([dit_request()], no_progress)[0][0]


def run_one(pipeline: DiffusersPipeline, request: GenerationRequest) -> np.ndarray:
    return pipeline.run([request], no_progress)[0][0]


def test_the_dit_announces_every_mode_and_the_unet_only_exact(
    dit: DiffusersPipeline, settings: GpuWorkerSettings
) -> None:
    assert dit.input_schema()[SPEED_KEY] == list(SPEED_MODES)
    unet = load_pipeline("tiny", CPU, settings)
    assert isinstance(unet, DiffusersPipeline)
    assert unet.input_schema()[SPEED_KEY] == ["exact"]


def test_exact_is_what_a_request_without_a_mode_computes(
    dit: DiffusersPipeline, exact: np.ndarray
) -> None:
    assert np.array_equal(run_one(dit, dit_request(speed="exact")), exact)
    report = dit.last_speed
    assert report is not None
    assert (report.mode, report.cache, report.block_calls_skipped) == ("exact", "none", 0)


def test_fast_skips_blocks_and_stays_close_to_exact(
    dit: DiffusersPipeline, exact: np.ndarray
) -> None:
    fast = run_one(dit, dit_request(speed="fast"))
    report = dit.last_speed
    assert report is not None
    assert (report.mode, report.cache, report.threshold) == ("fast", "first_block_cache", 0.15)
    # 2 double + 4 single blocks, one denoiser call per step (no true CFG): 6 x 8 calls.
    assert report.block_calls == 6 * STEPS
    assert report.block_calls_skipped > 0
    assert report.tf32 is False  # CPU: no TF32
    diff = np.abs(fast.astype(np.int16) - exact.astype(np.int16))
    assert 0 < diff.max() <= FAST_MAX_DIFF
    assert diff.mean() <= FAST_MEAN_DIFF
    other_seed = run_one(dit, dit_request(seed=8))
    assert np.abs(other_seed.astype(np.int16) - exact.astype(np.int16)).mean() > 20 * diff.mean()


def test_the_hooks_are_gone_after_a_fast_forward(dit: DiffusersPipeline, exact: np.ndarray) -> None:
    run_one(dit, dit_request(speed="fast"))
    assert not dit.pipe.transformer.is_cache_enabled
    assert np.array_equal(run_one(dit, dit_request()), exact)


def test_a_zero_threshold_is_exact(dit: DiffusersPipeline, exact: np.ndarray) -> None:
    thresholds = dict(dit.speed_thresholds)
    dit.speed_thresholds["fast"] = 0.0
    try:
        zero = run_one(dit, dit_request(speed="fast"))
    finally:
        dit.speed_thresholds = thresholds
    report = dit.last_speed
    assert report is not None
    assert (report.cache, report.block_calls, report.block_calls_skipped) == (
        "first_block_cache",
        6 * STEPS,
        0,
    )
    assert np.array_equal(zero, exact)


def test_a_batch_of_one_mode_is_one_forward_and_modes_never_mix(dit: DiffusersPipeline) -> None:
    fast = [dit_request(request_id=f"f{i}", seed=i, speed="fast") for i in range(2)]
    outputs = dit.run(fast, no_progress)
    assert [len(o) for o in outputs] == [1, 1]
    assert dit.last_speed is not None
    assert dit.last_speed.block_calls == 6 * STEPS
    with pytest.raises(ValueError, match="batch_key"):
        dit.run([fast[0], dit_request(request_id="e")], no_progress)
    queued = [
        SimpleNamespace(request=r, enqueued_at=0.0)
        for r in (fast[0], dit_request(request_id="e"), fast[1])
    ]
    assert [q.request.request_id for q in plan_batch(queued, 4)] == ["f0", "f1"]


def test_a_pipeline_without_the_hook_refuses_the_faster_modes(settings: GpuWorkerSettings) -> None:
    unet = load_pipeline("tiny", CPU, settings)
    request = dit_request(pipeline="tiny", extra_inputs={})
    unet.validate(request)
    for mode in ("balanced", "fast"):
        with pytest.raises(UnsupportedRequest, match=f"speed: tiny supports exact, not '{mode}'"):
            unet.validate(replace(request, speed=mode))


def test_a_pipeline_declaring_no_modes_is_refused_by_its_schema() -> None:
    class Plain:
        def input_schema(self) -> dict[str, object]:
            return {"type": "object", "properties": {}}

    assert declared_refusal("plain", Plain(), "exact") is None
    assert declared_refusal("plain", object(), "fast") == (
        "speed: plain supports exact, not 'fast'"
    )
    assert declared_refusal("plain", Plain(), "balanced") is not None


def test_lower_precision_is_restored_after_the_forward() -> None:
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    with lower_precision(enabled=True):
        assert torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before


def test_ranks_batch_one_mode_together_and_report_the_skips(
    coordinator_factory: Callable[..., Coordinator], settings: GpuWorkerSettings
) -> None:
    coordinator = coordinator_factory(
        "cpu:1", {"tiny-dit": "tiny-dit", "tiny": "tiny"}, max_batch=4, settings=settings
    )
    # A long forward first, so the others queue up behind it and are batched by the plan.
    busy = coordinator.submit(dit_request(request_id="busy", steps=40))
    modes = {"f1": "fast", "e1": "exact", "f2": "fast", "f3": "fast"}
    futures = {
        rid: coordinator.submit(dit_request(request_id=rid, seed=i, speed=mode))
        for i, (rid, mode) in enumerate(modes.items())
    }
    refused = coordinator.submit(
        dit_request(request_id="u", pipeline="tiny", speed="fast", extra_inputs={})
    )
    busy.result(GENEROUS_S)
    results = {rid: future.result(GENEROUS_S) for rid, future in futures.items()}
    sizes = {rid: r.metrics.batch_size if r.metrics else None for rid, r in results.items()}
    assert sizes == {"f1": 3, "e1": 1, "f2": 3, "f3": 3}
    fast = results["f1"].metrics
    assert fast is not None
    assert fast.speed is not None
    assert (fast.speed.mode, fast.speed.block_calls) == ("fast", 6 * STEPS)
    assert fast.speed.block_calls_skipped > 0
    exact = results["e1"].metrics
    assert exact is not None
    assert exact.speed is not None
    assert exact.speed.mode == "exact"
    with pytest.raises(JobFailed, match="speed: tiny supports exact, not 'fast'"):
        refused.result(GENEROUS_S)
