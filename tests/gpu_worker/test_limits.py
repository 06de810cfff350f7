"""What pipelines declare they take.

The tiny pipelines' own limits, limits derived from a diffusers model, the announced frame rule
against what `validate` enforces, and the coordinator getting the limits from its ranks and
keeping each batch within the declared memory budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import pytest
import torch

from kiln.common.limits import TINY_LIMITS, DeclaredLimits
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.limits import declared_limits
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.tasks.contract.limits import PipelineLimits
from tests.e2e.pipelines import SleepyPipeline
from tests.gpu_worker.conftest import GENEROUS_S, request
from tests.gpu_worker.fixtures import spec
from tests.gpu_worker.fixtures.base import FixturePipeline
from tests.gpu_worker.fixtures.budgeted import BUDGET

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> GpuWorkerSettings:
    return GpuWorkerSettings(model_cache=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tiny(settings: GpuWorkerSettings) -> DiffusersPipeline:
    pipeline = load_pipeline("tiny", CPU, settings)
    assert isinstance(pipeline, DiffusersPipeline)
    return pipeline


@pytest.fixture(scope="module")
def tiny_video(settings: GpuWorkerSettings) -> DiffusersPipeline:
    pipeline = load_pipeline("tiny-video", CPU, settings)
    assert isinstance(pipeline, DiffusersPipeline)
    return pipeline


def test_the_tiny_pipelines_declare_the_shared_presets(
    tiny: DiffusersPipeline, tiny_video: DiffusersPipeline
) -> None:
    assert tiny.limits() == TINY_LIMITS["tiny"]
    assert tiny_video.limits() == TINY_LIMITS["tiny-video"]


def test_a_wan_like_model_derives_4k_plus_1_frames_from_its_vae(
    tiny_video: DiffusersPipeline,
) -> None:
    derived = DiffusersPipeline(tiny_video.pipe, CPU, "wan-like").limits()
    # Wan's own defaults: 832×480, 81 frames, 50 steps; its VAE packs 4 frames per latent frame.
    assert derived == DeclaredLimits(
        max_width=1664,
        max_height=1664,
        size_multiple=16,
        max_steps=200,
        min_frames=1,
        max_frames=81,
        frame_step=4,
        max_pixels_frames_outputs=832 * 480 * 81 * 4,
    )


def test_an_image_model_derives_one_frame_and_its_native_size(tiny: DiffusersPipeline) -> None:
    derived = DiffusersPipeline(tiny.pipe, CPU, "sd-like").limits()
    # 8 latent cells × the VAE's 8 pixels per cell: 64 native, up to twice that per side.
    assert (derived["max_width"], derived["max_height"], derived["size_multiple"]) == (128, 128, 8)
    assert (derived["min_frames"], derived["max_frames"], derived["frame_step"]) == (1, 1, 1)
    assert derived["max_pixels_frames_outputs"] == 64 * 64 * 4


@pytest.mark.parametrize("spec", ["tiny", "tiny-video"])
def test_the_announced_frame_rule_is_the_one_validate_enforces(
    spec: str, tiny: DiffusersPipeline, tiny_video: DiffusersPipeline
) -> None:
    pipeline = tiny if spec == "tiny" else tiny_video
    limits = PipelineLimits.from_dict(pipeline.limits())
    for frames in range(1, 30):
        request = GenerationRequest(
            "r", spec, "p", 64, 64, steps=2, seed=0, num_frames=frames, guidance_scale=5.0
        )
        try:
            pipeline.validate(request)
            validated = True
        except UnsupportedRequest:
            validated = False
        assert (limits.violation(spec, request) is None) == validated, frames


def test_fixtures_declare_theirs_and_undeclared_pipelines_declare_nothing() -> None:
    assert declared_limits(SleepyPipeline(CPU)) == {"max_width": 1024, "max_steps": 300}
    assert declared_limits(FixturePipeline(CPU)) == {}


def test_a_misspelt_limit_is_refused_rather_than_silently_dropped() -> None:
    class Misspelt(FixturePipeline):
        def limits(self) -> dict[str, int]:
            return {"max_step": 10}

    with pytest.raises(ValueError, match="max_step"):
        declared_limits(Misspelt(CPU))


def test_the_coordinator_has_its_ranks_limits_and_batches_within_the_budget(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    pipelines = {"budgeted": spec("budgeted"), "base": spec("base")}
    coordinator = coordinator_factory("cpu:1", pipelines, max_batch=4, warmup=False)
    assert coordinator.pipeline_limits() == {
        "budgeted": {"max_pixels_frames_outputs": BUDGET, "max_steps": 50},
        "base": {},
    }
    # Keep the group busy so four 64×64 requests queue up: max_batch would put all four in one
    # forward, the budget allows two.
    busy = coordinator.submit(request("busy", "base", "slow", steps=20))
    futures = [coordinator.submit(request(f"b{i}", "budgeted", seed=i)) for i in range(4)]
    busy.result(GENEROUS_S)
    sizes = [future.result(GENEROUS_S).metrics for future in futures]
    assert [m.batch_size if m else None for m in sizes] == [2, 2, 2, 2]
