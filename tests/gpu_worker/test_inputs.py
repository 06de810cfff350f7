"""Pipelines declare their inputs: a schema derived from a diffusers `__call__`.

Extra inputs (a scheduler, eta) reach the pipeline call, and batch only with equal inputs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionInpaintPipeline

from kiln.common.limits import TINY_LIMITS
from kiln.common.request import FIELD_KEY, IMAGE_KEY
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.inputs import (
    declared_input_schema,
    extra_input_names,
    extra_inputs_refusal,
    inputs_key,
)
from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.diffusers_inputs import derive_input_schema
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.pipelines.signature_kinds import call_parameters
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings

CPU = torch.device("cpu")
UNSAFE = (
    "generator",
    "latents",
    "prompt_embeds",
    "negative_prompt_embeds",
    "output_type",
    "return_dict",
    "callback_on_step_end",
    "callback_on_step_end_tensor_inputs",
    "cross_attention_kwargs",
    "timesteps",
    "sigmas",
    "ip_adapter_image",  # the tiny pipeline has no image encoder
    "ip_adapter_image_embeds",
)


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
def tiny(settings: GpuWorkerSettings) -> DiffusersPipeline:
    pipeline = load_pipeline("tiny", CPU, settings)
    assert isinstance(pipeline, DiffusersPipeline)
    return pipeline


def image_request(**overrides: Any) -> GenerationRequest:
    base = GenerationRequest(
        request_id="r", pipeline="tiny", prompt="a red cat", width=64, height=64, steps=4,
        seed=7, guidance_scale=5.0,
    )  # fmt: skip
    return replace(base, **overrides)


def only(outputs: list[list[np.ndarray]]) -> np.ndarray:
    (request_outputs,) = outputs
    (frames,) = request_outputs
    return frames


def test_the_tiny_schema_lists_its_call_arguments_and_its_schedulers(
    tiny: DiffusersPipeline,
) -> None:
    schema = declared_input_schema(tiny)
    assert schema is not None
    assert (schema["type"], schema["additionalProperties"]) == ("object", False)
    properties = schema["properties"]
    fields = {name: prop[FIELD_KEY] for name, prop in properties.items() if FIELD_KEY in prop}
    assert fields == {
        "prompt": "prompt",
        "negative_prompt": "negative_prompt",
        "height": "height",
        "width": "width",
        "num_inference_steps": "steps",
        "guidance_scale": "guidance_scale",
        "num_images_per_prompt": "num_outputs",
        "seed": "seed",
    }
    assert extra_input_names(schema) == {"eta", "guidance_rescale", "clip_skip", "scheduler"}
    for name in UNSAFE:
        assert name not in properties, name
    # The pipeline's own limits are the ranges of its request fields.
    limits = TINY_LIMITS["tiny"]
    assert properties["width"]["maximum"] == limits["max_width"]
    assert properties["width"]["multipleOf"] == limits["size_multiple"]
    assert properties["num_inference_steps"]["maximum"] == limits["max_steps"]
    assert properties["eta"] == {"type": "number", "minimum": 0.0, "maximum": 1.0, "default": 0.0}
    assert properties["clip_skip"] == {"type": "integer", "minimum": 0, "maximum": 1}  # 2 layers
    scheduler = properties["scheduler"]
    assert scheduler["default"] == scheduler["enum"][0] == "EulerDiscreteScheduler"
    assert {"DDIMScheduler", "DPMSolverMultistepScheduler", "PNDMScheduler"} <= set(
        scheduler["enum"]
    )
    # Compatible in name, unbuildable here (scipy / torchsde are not installed): not offered.
    assert "LMSDiscreteScheduler" not in scheduler["enum"]


def test_the_tiny_video_schema_has_frames_and_its_one_scheduler(
    settings: GpuWorkerSettings,
) -> None:
    video = load_pipeline("tiny-video", CPU, settings)
    schema = declared_input_schema(video)
    assert schema is not None
    properties = schema["properties"]
    assert properties["num_frames"][FIELD_KEY] == "num_frames"
    assert properties["num_frames"]["maximum"] == TINY_LIMITS["tiny-video"]["max_frames"]
    assert properties["num_videos_per_prompt"][FIELD_KEY] == "num_outputs"
    assert properties["scheduler"]["enum"] == ["FlowMatchEulerDiscreteScheduler"]
    assert properties["max_sequence_length"] == {
        "type": "integer", "minimum": 1, "maximum": 512, "default": 512,
    }  # fmt: skip
    assert "guidance_scale_2" not in properties  # needs a second transformer


def test_image_inputs_and_strength_come_from_an_inpainting_signature() -> None:
    # A pipeline class Kiln has no code for: only its `__call__` signature is read.
    parameters = call_parameters(StableDiffusionInpaintPipeline)
    pipe = SimpleNamespace(scheduler=None)
    schema = derive_input_schema(
        pipe, parameters, TINY_LIMITS["tiny"], title="t", is_video=False, schedulers=[]
    )
    properties = schema["properties"]
    for name in ("image", "mask_image"):
        assert properties[name][IMAGE_KEY] is True
        assert properties[name]["type"] == "string"
    assert properties["strength"] == {"type": "number", "minimum": 0.0, "maximum": 1.0,
                                      "default": 1.0}  # fmt: skip
    assert properties["padding_mask_crop"] == {"type": "integer", "minimum": 0}
    assert "masked_image_latents" not in properties
    assert "scheduler" not in properties  # no scheduler to offer others for


class Custom:
    """A made-up pipeline: the allow-list decides, not the names Kiln happens to know."""

    def __call__(
        self,
        prompt: str | list[str] | None = None,
        mode: Literal["fast", "fine"] = "fast",
        sharpen: bool = False,
        chunk: int = 8,
        label: str | None = None,
        weights: dict[str, float] | None = None,
        mask: torch.Tensor | None = None,
        fps: int = 7,
        on_step: Any = None,
    ) -> None:
        """Never called."""


def test_only_json_safe_parameters_of_an_unknown_pipeline_become_inputs() -> None:
    parameters = call_parameters(Custom)  # this module's annotations are strings
    schema = derive_input_schema(
        Custom(), parameters, TINY_LIMITS["tiny"], title="custom", is_video=False, schedulers=[]
    )
    properties = schema["properties"]
    assert properties["mode"] == {"enum": ["fast", "fine"], "default": "fast"}
    assert properties["sharpen"] == {"type": "boolean", "default": False}
    assert properties["chunk"] == {"type": "integer", "minimum": 0, "maximum": 32, "default": 8}
    assert properties["label"] == {"type": "string", "maxLength": 4000}
    for name in ("weights", "mask", "fps", "on_step", "self"):
        assert name not in properties, name
    assert schema["x-kiln-pipeline-class"] == "Custom"


def test_a_scheduler_input_changes_the_output_as_that_scheduler_would(
    tiny: DiffusersPipeline, settings: GpuWorkerSettings
) -> None:
    default = only(tiny.run([image_request()], no_progress))
    ddim = only(tiny.run([image_request(extra_inputs={"scheduler": "DDIMScheduler"})], no_progress))
    assert not np.array_equal(default, ddim)
    # The reference: the same model whose scheduler is DDIM from the start.
    reference = load_pipeline("tiny", CPU, settings)
    assert isinstance(reference, DiffusersPipeline)
    reference.pipe.scheduler = DDIMScheduler.from_config(reference.pipe.scheduler.config)
    assert np.array_equal(only(reference.run([image_request()], no_progress)), ddim)
    # The swap lasts one call: the default scheduler is back.
    assert np.array_equal(only(tiny.run([image_request()], no_progress)), default)
    assert type(tiny.pipe.scheduler).__name__ == "EulerDiscreteScheduler"


def test_a_plain_extra_input_reaches_the_call(tiny: DiffusersPipeline) -> None:
    # DDIM with eta > 0 adds fresh noise at every step: eta must have been passed.
    ddim = {"scheduler": "DDIMScheduler"}
    still = only(tiny.run([image_request(extra_inputs={**ddim, "eta": 0.0})], no_progress))
    noisy = only(tiny.run([image_request(extra_inputs={**ddim, "eta": 1})], no_progress))
    assert not np.array_equal(still, noisy)


def test_requests_batch_only_with_equal_inputs(tiny: DiffusersPipeline) -> None:
    plain = image_request(request_id="a")
    ddim = image_request(request_id="b", extra_inputs={"scheduler": "DDIMScheduler"})
    same = image_request(request_id="c", extra_inputs={"scheduler": "DDIMScheduler"})
    assert plain.batch_key() != ddim.batch_key()
    assert ddim.batch_key() == same.batch_key()
    assert inputs_key({"b": 1, "a": 2}) == inputs_key({"a": 2, "b": 1})
    with pytest.raises(ValueError, match="batch_key"):
        tiny.run([plain, ddim], no_progress)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"strength": 0.5}, "inputs.strength: tiny takes no such input"),
        ({"scheduler": "LMSDiscreteScheduler"}, "inputs.scheduler: 'LMSDiscreteScheduler' is not"),
        ({"generator": 3}, "inputs.generator: tiny takes no such input"),
    ],
)
def test_the_pipeline_refuses_inputs_it_does_not_declare(
    tiny: DiffusersPipeline, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(UnsupportedRequest, match=message):
        tiny.validate(image_request(extra_inputs=extra))


def test_ranks_refuse_undeclared_inputs() -> None:
    schema = {"properties": {"image": {"type": "string", IMAGE_KEY: True}, "eta": {}}}
    assert extra_inputs_refusal("p", schema, {}) is None
    assert extra_inputs_refusal("p", schema, {"eta": 0.5}) is None
    assert extra_inputs_refusal("p", None, {"eta": 0.5}) == (
        "inputs.eta: p declares no inputs besides the request fields"
    )
    # an image input's form and bytes are the node's concern; ranks check the name only
    assert extra_inputs_refusal("p", schema, {"image": "sha256:00"}) is None


def test_a_schema_must_be_json(tmp_path: Path) -> None:
    class Declares:
        def input_schema(self) -> dict[str, Any]:
            return {"properties": {"x": {"default": tmp_path}}}

    with pytest.raises(TypeError):
        declared_input_schema(Declares())
    assert declared_input_schema(object()) is None
