"""Previews while denoising: the fitted latent→RGB map, the tiny autoencoder, real CPU ranks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.previews import fit_linear_map, preview_pixels
from kiln.gpu_worker.protocol import PreviewSpec, StepProgress
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.conftest import GENEROUS_S, request, start_coordinator

# Mean absolute error per RGB channel (0-255 levels) between the fitted linear preview of the
# last step and the decoded output shrunk to the preview's size (area average), on the tiny
# pipeline (64×64, 4 steps, random weights), seeds 1-3: 14.5-26.0 levels per channel, 19-20.5 on
# average. The tiny VAE is random, so its output is a weak linear function of the latents: the
# best linear map there is (least squares on those very final latents, `best_linear_error`) gets
# 13.8-22.8 (17-19 on average), a flat mean-colour image 16-29. The bounds: every channel within
# 32 levels, and the average within 1.25x the best linear map's (measured 1.07-1.12x). The
# unfitted map (latents as RGB) misses by 36-88 levels and fails both.
CHANNEL_MAE_BOUND = 32.0
BEST_LINEAR_RATIO_BOUND = 1.25


class LatentsAtEnd:
    """A step callback that keeps the latents of the last step (a `LatentsObserver`)."""

    def __init__(self) -> None:
        self.latents: torch.Tensor | None = None
        self.steps: list[int] = []

    def __call__(self, step: int, total: int) -> None:
        del total
        self.steps.append(step)

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Keep a copy of the latents after this step."""
        del step, total
        self.latents = latents.detach().clone()


@functools.cache
def tiny_pipeline() -> DiffusersPipeline:
    """The tiny pipeline, loaded once for the tests that run it here (each run is seeded)."""
    pipeline = load_pipeline("tiny", torch.device("cpu"))
    assert isinstance(pipeline, DiffusersPipeline)
    return pipeline


def final_step(seed: int) -> tuple[DiffusersPipeline, torch.Tensor, np.ndarray]:
    """The tiny pipeline, the latents of its last step (4 steps) and its decoded output."""
    pipeline = tiny_pipeline()
    assert isinstance(pipeline, DiffusersPipeline)
    observer = LatentsAtEnd()
    outputs = pipeline.run([request("fit", "tiny", steps=4, seed=seed)], observer)
    assert observer.steps == [1, 2, 3, 4]
    assert observer.latents is not None
    return pipeline, observer.latents[:1], outputs[0][0][0]


def shrunk(output: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """An (H, W, 3) uint8 image area-averaged to `size`, as float levels."""
    image = torch.from_numpy(output).permute(2, 0, 1)[None].double()
    small = F.interpolate(image, size=size, mode="area")[0].permute(1, 2, 0)
    result: np.ndarray = small.numpy()
    return result


def best_linear_error(latents: torch.Tensor, target: np.ndarray) -> np.ndarray:
    """Per channel MAE of the least-squares linear map from these latents to `target` itself."""
    inputs = latents[0].permute(1, 2, 0).reshape(-1, latents.shape[1]).double()
    inputs = torch.cat([inputs, torch.ones(inputs.shape[0], 1, dtype=torch.double)], dim=1)
    wanted = torch.from_numpy(target.reshape(-1, 3))
    fitted = (inputs @ torch.linalg.lstsq(inputs, wanted).solution).clamp(0, 255)
    errors: np.ndarray = (fitted - wanted).abs().mean(dim=0).numpy()
    return errors


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fitted_preview_of_the_last_step_is_close_to_the_decoded_output(seed: int) -> None:
    pipeline, latents, output = final_step(seed)
    linear = fit_linear_map(pipeline.pipe.vae)
    preview = preview_pixels(linear(latents), 256).astype(np.float64)
    target = shrunk(output, preview.shape[:2])
    errors = np.abs(preview - target).mean(axis=(0, 1))
    best = best_linear_error(latents, target)
    print(f"seed {seed}: MAE per channel {np.round(errors, 1)}, best linear {np.round(best, 1)}")
    assert (errors <= CHANNEL_MAE_BOUND).all(), errors
    assert errors.mean() <= BEST_LINEAR_RATIO_BOUND * best.mean(), (errors, best)


def test_an_unfitted_map_is_far_from_the_output() -> None:
    """The bounds above can fail: the first three latent channels as RGB miss by far more."""
    _, latents, output = final_step(1)
    raw = preview_pixels(latents[:, :3], 256).astype(np.float64)
    target = shrunk(output, raw.shape[:2])
    errors = np.abs(raw - target).mean(axis=(0, 1))
    assert errors.max() > CHANNEL_MAE_BOUND
    assert errors.mean() > BEST_LINEAR_RATIO_BOUND * best_linear_error(latents, target).mean()


def previews_of(coordinator: Coordinator, **fields: Any) -> tuple[list[StepProgress], Any]:
    """Run one request; the progress reports that carried a preview, and the result."""
    seen: list[StepProgress] = []
    future = coordinator.submit(request("p", **fields), on_progress=seen.append)
    result = future.result(timeout=GENEROUS_S)
    return [p for p in seen if p.preview is not None], result


@pytest.fixture(scope="module")
def ranks() -> Iterator[Coordinator]:
    """One CPU rank serving the tiny image and video pipelines, previews by the fitted map."""
    coordinator = start_coordinator("cpu:1", {"tiny": "tiny", "video": "tiny-video"})
    yield coordinator
    coordinator.shutdown()


def test_previews_arrive_for_the_steps_asked_in_order(ranks: Coordinator) -> None:
    previews, result = previews_of(
        ranks, pipeline="tiny", steps=6, preview=PreviewSpec(every_steps=2)
    )
    assert [(p.step, p.total) for p in previews] == [(2, 6), (4, 6), (6, 6)]
    for progress in previews:
        assert progress.stage == "denoising"
        assert progress.preview is not None
        assert progress.preview.shape == (8, 8, 3)  # the latents' size: 64 / 8
        assert progress.preview.dtype == np.uint8
    assert result.outputs[0].shape == (1, 64, 64, 3)


def test_no_previews_unless_asked(ranks: Coordinator) -> None:
    previews, _ = previews_of(ranks, pipeline="tiny", steps=2)
    assert previews == []


def test_a_video_previews_its_middle_frame(ranks: Coordinator) -> None:
    previews, result = previews_of(
        ranks, pipeline="video", steps=2, num_frames=5, preview=PreviewSpec(every_steps=1)
    )
    assert [p.step for p in previews] == [1, 2]
    assert all(p.preview is not None and p.preview.shape == (8, 8, 3) for p in previews)
    assert result.outputs[0].shape[0] == 5


def tiny_autoencoder(folder: Path) -> Path:
    """A random diffusers AutoencoderTiny for 4-channel latents, saved and loaded back."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    vae = AutoencoderTiny(
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 1),
        num_decoder_blocks=(1, 1, 1, 1),
        latent_channels=4,
    )
    vae.save_pretrained(folder)  # type: ignore[attr-defined]
    AutoencoderTiny.from_pretrained(folder)  # loads back, as the rank will
    return folder


def test_a_tiny_autoencoder_decodes_full_size_previews(tmp_path: Path) -> None:
    settings = GpuWorkerSettings(preview_vae=tiny_autoencoder(tmp_path / "taesd"))
    coordinator = start_coordinator("cpu:1", {"tiny": "tiny"}, settings=settings)
    try:
        spec = PreviewSpec(every_steps=1, max_side=32, format="png")
        previews, _ = previews_of(coordinator, pipeline="tiny", steps=2, preview=spec)
    finally:
        coordinator.shutdown()
    assert [p.step for p in previews] == [1, 2]
    # the tiny autoencoder decodes to pixels (64×64), shrunk to the asked longer side
    assert all(p.preview is not None and p.preview.shape == (32, 32, 3) for p in previews)
