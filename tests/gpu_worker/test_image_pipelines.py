"""The image-conditioned tiny pipelines: image-to-video from tiny-video's own components.

In process, on CPU: what the schema requires, what a request without its image gets, and that the
image steers the frames (the same image, the same frames; another image, others).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.images import InputImage
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.e2e.image_server import CAT, DOG

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def i2v(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiffusersPipeline]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic for both runs below, whatever the load
    settings = GpuWorkerSettings(model_cache=tmp_path_factory.mktemp("models"))
    pipeline = load_pipeline("tiny-i2v", CPU, settings)
    assert isinstance(pipeline, DiffusersPipeline)
    yield pipeline
    torch.set_num_threads(threads)


def request(image: bytes | None) -> GenerationRequest:
    images = (
        {"image": InputImage(hashlib.sha256(image).hexdigest(), image, 80, 48)} if image else {}
    )
    return GenerationRequest(
        request_id="r", pipeline="tiny-i2v", prompt="a kiln", width=64, height=64, steps=2,
        seed=3, num_frames=5, guidance_scale=1.0,
        extra_inputs={name: item.ref for name, item in images.items()}, images=images,
    )  # fmt: skip


def frames(pipeline: DiffusersPipeline, image: bytes) -> np.ndarray:
    ((video,),) = pipeline.run([request(image)], lambda _step, _total: None)
    return video


def test_image_to_video_needs_its_image_and_follows_it(i2v: DiffusersPipeline) -> None:
    schema = i2v.input_schema()
    assert schema["x-kiln-pipeline-class"] == "WanImageToVideoPipeline"
    assert schema["required"] == ["image"]
    assert schema["properties"]["image"]["x-kiln-image"] is True
    with pytest.raises(UnsupportedRequest, match=r"inputs\.image: tiny-i2v needs this image input"):
        i2v.validate(request(None))
    cat = frames(i2v, CAT)
    assert cat.shape == (5, 64, 64, 3)
    assert np.array_equal(frames(i2v, CAT), cat)
    assert not np.array_equal(frames(i2v, DOG), cat)
