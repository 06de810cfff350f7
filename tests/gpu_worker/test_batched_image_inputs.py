"""Image-input pipelines batched: an output depends only on its own request, never on its mates.

In process, on CPU, with the tiny image-conditioned pipelines (`tiny-inpaint`, `tiny-img2img`,
`tiny-i2v`). A request is run beside an identical request, beside a different one (another
prompt, seed and output count; the same images and inputs, as a batch key demands) and alone.

Everything random (the noise, the sampled latents of the encoded images, the scheduler's noise)
comes from the output's own generator, so the latents after the first step match the run alone
up to float rounding (a few 1e-6 of their largest value here; a wrong generator moves them by
about their size). Pixels match exactly between identical requests in one forward; against the
run alone they may differ by 1 level of 255, because the CPU's kernels (oneDNN's convolutions
among them) round differently at another batch size.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch

from kiln.gpu_worker.images import InputImage
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.e2e.image_server import CAT, MASK

CPU = torch.device("cpu")
PIPELINES = ("tiny-inpaint", "tiny-img2img", "tiny-i2v")
# Latents of one output batched vs alone, relative to their largest value: float rounding only.
LATENT_ROUNDING = 1e-4
PIXEL_ROUNDING = 1  # levels of 255: the CPU's kernels at another batch size


class FirstStepLatents:
    """A step callback that keeps the latents after the first step, one row per output."""

    def __init__(self) -> None:
        self.latents: torch.Tensor | None = None

    def __call__(self, step: int, total: int) -> None:
        pass

    def observe_latents(self, step: int, _total: int, latents: torch.Tensor) -> None:
        if step == 1:
            self.latents = latents.detach().clone()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same kernels for every run below, whatever the load
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> GpuWorkerSettings:
    return GpuWorkerSettings(model_cache=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def pipelines(settings: GpuWorkerSettings) -> dict[str, DiffusersPipeline]:
    loaded: dict[str, DiffusersPipeline] = {}
    for name in PIPELINES:
        pipeline = load_pipeline(name, CPU, settings)
        assert isinstance(pipeline, DiffusersPipeline)
        loaded[name] = pipeline
    return loaded


@pytest.fixture(params=PIPELINES)
def pipeline(
    request: pytest.FixtureRequest, pipelines: dict[str, DiffusersPipeline]
) -> DiffusersPipeline:
    return pipelines[request.param]


def input_image(data: bytes) -> InputImage:
    return InputImage(hashlib.sha256(data).hexdigest(), data, 80, 48)


def base_request(pipeline: DiffusersPipeline) -> GenerationRequest:
    """The e2e inpainting request's shape: 64 × 96, the cat image (and the mask)."""
    images = {"image": input_image(CAT)}
    extra: dict[str, float] = {}
    if pipeline.name == "tiny-inpaint":
        images["mask_image"] = input_image(MASK)
    if pipeline.name == "tiny-img2img":
        extra["strength"] = 0.6  # the image's noised latents are where the denoising starts
    is_video = pipeline.name == "tiny-i2v"
    return GenerationRequest(
        request_id="a", pipeline=pipeline.name, prompt="a kiln", width=64,
        height=64 if is_video else 96, steps=3 if pipeline.name == "tiny-img2img" else 2,
        seed=3, num_frames=5 if is_video else 1, guidance_scale=5.0,
        extra_inputs={**{name: image.ref for name, image in images.items()}, **extra},
        images=images,
    )  # fmt: skip


def run(
    pipeline: DiffusersPipeline, requests: list[GenerationRequest]
) -> tuple[list[list[np.ndarray]], torch.Tensor]:
    """The batch's outputs and its latents after the first step."""
    observer = FirstStepLatents()
    outputs = pipeline.run(requests, observer)
    assert observer.latents is not None
    return outputs, observer.latents


def pixel_difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


def latent_difference(a: torch.Tensor, alone: torch.Tensor) -> float:
    """The largest difference, relative to the largest latent of the run alone."""
    return float((a - alone).abs().max() / alone.abs().max().clamp(min=1.0))


def test_identical_requests_sharing_a_forward_give_the_same_bytes_as_alone(
    pipeline: DiffusersPipeline,
) -> None:
    first = base_request(pipeline)
    second = replace(first, request_id="b")
    (alone,), alone_latents = run(pipeline, [first])
    (together_first, together_second), latents = run(pipeline, [first, second])
    assert together_first[0].tobytes() == together_second[0].tobytes()
    assert latent_difference(latents[0], alone_latents[0]) < LATENT_ROUNDING
    assert latent_difference(latents[1], alone_latents[0]) < LATENT_ROUNDING
    assert pixel_difference(together_second[0], alone[0]) <= PIXEL_ROUNDING


def test_a_request_beside_a_different_one_is_what_it_is_alone(
    pipeline: DiffusersPipeline,
) -> None:
    first = base_request(pipeline)
    other = replace(first, request_id="b", prompt="a castle at dusk", seed=11, num_outputs=2)
    ((alone_first,),), first_latents = run(pipeline, [first])
    (alone_other,), other_latents = run(pipeline, [other])
    (together_first, together_other), latents = run(pipeline, [first, other])
    assert latent_difference(latents[0], first_latents[0]) < LATENT_ROUNDING
    assert latent_difference(latents[1:], other_latents) < LATENT_ROUNDING
    assert pixel_difference(together_first[0], alone_first) <= PIXEL_ROUNDING
    for together, alone in zip(together_other, alone_other, strict=True):
        assert pixel_difference(together, alone) <= PIXEL_ROUNDING


def test_output_i_is_the_request_with_seed_plus_i_alone(pipeline: DiffusersPipeline) -> None:
    two = replace(base_request(pipeline), seed=20, num_outputs=2)
    ((_, second),), latents = run(pipeline, [two])
    ((alone,),), alone_latents = run(pipeline, [replace(two, seed=21, num_outputs=1)])
    assert latent_difference(latents[1], alone_latents[0]) < LATENT_ROUNDING
    assert pixel_difference(second, alone) <= PIXEL_ROUNDING


@pytest.mark.parametrize("name", ["tiny-inpaint", "tiny-img2img"])
def test_a_scheduler_that_adds_noise_at_every_step_draws_it_per_output(
    pipelines: dict[str, DiffusersPipeline], name: str
) -> None:
    pipeline = pipelines[name]
    base = base_request(pipeline)
    ancestral = {**base.extra_inputs, "scheduler": "EulerAncestralDiscreteScheduler"}
    first = replace(base, extra_inputs=ancestral, steps=3)
    other = replace(first, request_id="b", prompt="a castle at dusk", seed=11)
    ((alone_first,),), first_latents = run(pipeline, [first])
    ((alone_other,),), other_latents = run(pipeline, [other])
    (together_first, together_other), latents = run(pipeline, [first, other])
    assert latent_difference(latents[0], first_latents[0]) < LATENT_ROUNDING
    assert latent_difference(latents[1], other_latents[0]) < LATENT_ROUNDING
    assert pixel_difference(together_first[0], alone_first) <= PIXEL_ROUNDING
    assert pixel_difference(together_other[0], alone_other) <= PIXEL_ROUNDING
