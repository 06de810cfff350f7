"""Any diffusers `DiffusionPipeline` (text or image to image or video) behind Kiln's `Pipeline`.

Loaded with `from_pretrained` from a local folder or a hub id; `HF_HUB_OFFLINE=1` is honoured by
huggingface_hub itself, so a worker that must not touch the network sets it in its environment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from diffusers import DiffusionPipeline

from kiln.gpu_worker.errors import JobFailed, UnsupportedRequest
from kiln.gpu_worker.inputs import (
    InputSchema,
    InputValue,
    extra_input_names,
    extra_inputs_refusal,
)
from kiln.gpu_worker.limits import DeclaredLimits
from kiln.gpu_worker.pipelines.base import StepCallback
from kiln.gpu_worker.pipelines.diffusers_inputs import (
    SCHEDULER_INPUT,
    call_parameters,
    compatible_schedulers,
    derive_input_schema,
    quiet_diffusers,
)
from kiln.gpu_worker.pipelines.diffusers_limits import derive_limits
from kiln.gpu_worker.pipelines.image_pipelines import image_call_kwargs, missing_image
from kiln.gpu_worker.pipelines.lora import AdapterCache, no_adapters
from kiln.gpu_worker.protocol import GenerationRequest

SEED_MASK = (1 << 63) - 1

# Fields every wrapped pipeline honours; the others depend on the pipeline's `__call__`.
_BASE_FIELDS = frozenset(
    {"request_id", "pipeline", "prompt", "width", "height", "steps", "seed", "num_outputs"}
)


def output_seed(seed: int, index: int) -> int:
    """Seed of output `index` of a request: `seed + index`, the same whatever else is batched."""
    return (seed + index) & SEED_MASK


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (float16 where bf16 is unsupported), float32 on CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float pixels in [0, 1] to uint8, rounding like diffusers' own `numpy_to_pil`."""
    scaled: np.ndarray = np.clip(frames, 0.0, 1.0) * 255.0
    return scaled.round().astype(np.uint8)


class DiffusersPipeline:
    """A loaded diffusers pipeline on one device; stays resident between requests."""

    def __init__(
        self,
        pipe: DiffusionPipeline,
        device: torch.device,
        name: str,
        limits: DeclaredLimits | None = None,
    ) -> None:
        self.pipe: Any = pipe  # diffusers' pipelines are dynamically typed
        self.device = device
        self.name = name
        parameters = call_parameters(type(pipe))
        self._call_params = frozenset(parameters)
        self._call_defaults = {n: p.default for n, p in parameters.items()}
        self.is_video = "num_frames" in self._call_params
        self._limits = limits
        self._parameters = dict(parameters)
        self._default_scheduler: Any = getattr(pipe, "scheduler", None)
        self._scheduler_classes: dict[str, Any] | None = None  # found on first use
        self._schedulers: dict[str, Any] = {}  # built from the default's config, kept
        self._schema: InputSchema | None = None
        self.adapters: AdapterCache = no_adapters(pipe)  # the loader gives the node's adapters

    @classmethod
    def load(
        cls,
        source: str,
        device: torch.device,
        *,
        name: str | None = None,
        dtype: torch.dtype | None = None,
        limits: DeclaredLimits | None = None,
    ) -> DiffusersPipeline:
        """`from_pretrained(source)` in the device's dtype, moved to `device`, progress bars off."""
        # `limits`, when given, replaces what `limits()` would derive from the model.
        pipe = DiffusionPipeline.from_pretrained(source, dtype=dtype or default_dtype(device))
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, name or f"diffusers:{source}", limits)

    def supported_fields(self) -> frozenset[str]:
        """The request fields this pipeline's `__call__` can honour."""
        optional = {"negative_prompt", "guidance_scale"} & self._call_params
        if self.is_video:
            optional.add("num_frames")
        return _BASE_FIELDS | optional

    def limits(self) -> DeclaredLimits:
        """The limits given at load, else ones derived from the model's own defaults."""
        if self._limits is not None:
            return DeclaredLimits(**self._limits)
        temporal = self._temporal() if self.is_video else None
        return derive_limits(
            self.pipe,
            self._call_defaults,
            size_multiple=self._size_multiple(),
            temporal=temporal,
            denoiser=self.denoiser(),
        )

    def input_schema(self) -> InputSchema:
        """What this pipeline takes, derived from its `__call__` (see `diffusers_inputs`)."""
        if self._schema is None:
            self._schema = derive_input_schema(
                self.pipe,
                self._parameters,
                self.limits(),
                title=f"{self.name} inputs",
                is_video=self.is_video,
                schedulers=list(self._compatible_schedulers()),
            )
        return self._schema

    def _compatible_schedulers(self) -> dict[str, Any]:
        if self._scheduler_classes is None:
            self._scheduler_classes = compatible_schedulers(self._default_scheduler)
        return self._scheduler_classes

    def validate(self, request: GenerationRequest) -> None:
        """Raise `UnsupportedRequest` naming the field the pipeline cannot serve as asked."""
        self.adapters.check(request)
        refusal = extra_inputs_refusal(self.name, self.input_schema(), request.extra_inputs)
        refusal = refusal or missing_image(self.name, self.input_schema(), request)
        if refusal is not None:
            raise UnsupportedRequest(refusal)
        scheduler = request.extra_inputs.get(SCHEDULER_INPUT)
        if scheduler is not None and scheduler not in self._compatible_schedulers():
            raise UnsupportedRequest(
                f"inputs.{SCHEDULER_INPUT}: {scheduler!r} is not one of "
                f"{sorted(self._compatible_schedulers())}"
            )
        if request.steps < 1:
            raise UnsupportedRequest(f"steps: must be at least 1, got {request.steps}")
        if request.num_outputs < 1:
            raise UnsupportedRequest(f"num_outputs: must be at least 1, got {request.num_outputs}")
        if request.negative_prompt is not None and "negative_prompt" not in self._call_params:
            raise UnsupportedRequest(f"negative_prompt: {type(self.pipe).__name__} takes none")
        self._validate_frames(request.num_frames)
        multiple = self._size_multiple()
        for field_name, value in (("width", request.width), ("height", request.height)):
            if value < multiple or value % multiple:
                raise UnsupportedRequest(
                    f"{field_name}: {value} is not a positive multiple of {multiple} "
                    f"for {self.name}"
                )

    def _validate_frames(self, num_frames: int) -> None:
        if not self.is_video:
            if num_frames != 1:
                raise UnsupportedRequest(
                    f"num_frames: {self.name} is an image pipeline; it makes 1 frame, "
                    f"not {num_frames}"
                )
            return
        temporal = self._temporal()
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise UnsupportedRequest(
                f"num_frames: {num_frames} must be {temporal}*k + 1 for {self.name}"
            )

    def _temporal(self) -> int:
        # Frames per latent frame: a video VAE takes 1 + temporal * k frames (Wan: 4).
        return int(getattr(self.pipe, "vae_scale_factor_temporal", 1) or 1)

    def _size_multiple(self) -> int:
        # Pixels per latent cell times the denoiser's spatial patch: what the pipeline would
        # otherwise silently round the size down to.
        spatial: Any = getattr(self.pipe, "vae_scale_factor_spatial", None)
        spatial = spatial or getattr(self.pipe, "vae_scale_factor", 8)
        module = self.denoiser()
        patch: Any = getattr(getattr(module, "config", None), "patch_size", None) or 1
        if isinstance(patch, (tuple, list)):
            patch = patch[-1]
        return int(spatial) * int(patch)

    def denoiser(self) -> torch.nn.Module | None:
        """The per-step module: the pipeline's transformer, else its unet."""
        for attribute in ("transformer", "unet"):
            module = getattr(self.pipe, attribute, None)
            if isinstance(module, torch.nn.Module):
                return module
        return None

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        """One forward for a batch of compatible requests; per request, per output, (F,H,W,3)."""
        if not requests:
            return []
        _check_compatible(requests)
        for request in requests:  # never let diffusers silently round a size or frame count
            self.validate(request)
        kwargs = self._call_kwargs(requests, on_step_end)
        with (
            self.adapters.applied(requests[0]),  # outside inference mode: it changes weights
            torch.inference_mode(),
            self._scheduler(requests[0].extra_inputs),
        ):
            result = self.pipe(**kwargs)
        frames = self._frames_of(result, requests[0])
        outputs: list[list[np.ndarray]] = []
        start = 0
        for request in requests:
            outputs.append([frames[i] for i in range(start, start + request.num_outputs)])
            start += request.num_outputs
        return outputs

    def _call_kwargs(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> dict[str, Any]:
        first = requests[0]
        # One prompt and one generator per output: diffusers draws each latent from its own
        # generator, so an output's pixels do not depend on what it was batched with.
        prompts = [r.prompt for r in requests for _ in range(r.num_outputs)]
        generators = [
            torch.Generator(device="cpu").manual_seed(output_seed(r.seed, i))
            for r in requests
            for i in range(r.num_outputs)
        ]
        kwargs: dict[str, Any] = {
            "prompt": prompts,
            "width": first.width,
            "height": first.height,
            "num_inference_steps": first.steps,
            "generator": generators,
            "output_type": "np",
        }
        if "negative_prompt" in self._call_params:
            # "" for a request without one: what the pipelines use for None, so a mixed batch
            # computes exactly what the separate runs would.
            kwargs["negative_prompt"] = [
                r.negative_prompt or "" for r in requests for _ in range(r.num_outputs)
            ]
        if "guidance_scale" in self._call_params:
            kwargs["guidance_scale"] = first.guidance_scale
        if self.is_video:
            kwargs["num_frames"] = first.num_frames
        kwargs.update(self._extra_kwargs(first.extra_inputs))
        kwargs = image_call_kwargs(kwargs, first, self.input_schema(), self._call_params)
        kwargs.update(self._callback_kwargs(first.steps, on_step_end))
        return kwargs

    def _extra_kwargs(self, extra_inputs: Mapping[str, InputValue]) -> dict[str, Any]:
        """The request's extra inputs as call arguments: only names the schema declares."""
        schema = self.input_schema()
        allowed = extra_input_names(schema) - {SCHEDULER_INPUT}
        kwargs: dict[str, Any] = {}
        for name, value in extra_inputs.items():
            if name not in allowed:
                continue  # `scheduler` is applied around the call; validate refused the rest
            kind = schema["properties"][name].get("type")
            # JSON has one kind of number: an integer parameter gets an int, a number a float.
            if kind == "integer" and isinstance(value, float) and value.is_integer():
                value = int(value)
            elif kind == "number" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            kwargs[name] = value
        return kwargs

    @contextlib.contextmanager
    def _scheduler(self, extra_inputs: Mapping[str, InputValue]) -> Iterator[None]:
        """Swap in the scheduler a batch asks for (built once, from the default's config)."""
        wanted = extra_inputs.get(SCHEDULER_INPUT)
        if wanted is None or wanted == type(self._default_scheduler).__name__:
            yield
            return
        scheduler = self._schedulers.get(str(wanted))
        if scheduler is None:
            cls = self._compatible_schedulers()[str(wanted)]
            with quiet_diffusers():
                scheduler = cls.from_config(self._default_scheduler.config)
            self._schedulers[str(wanted)] = scheduler
        self.pipe.scheduler = scheduler
        try:
            yield
        finally:
            self.pipe.scheduler = self._default_scheduler

    def _callback_kwargs(self, steps: int, on_step_end: StepCallback) -> dict[str, Any]:
        def total() -> int:
            # Pipelines record the true count of timesteps (some schedulers add steps).
            return int(getattr(self.pipe, "_num_timesteps", None) or steps)

        if "callback_on_step_end" in self._call_params:
            # An exception raised here (StopDenoising) leaves the denoising loop at once.
            def on_step(
                _pipe: Any, step_index: int, _timestep: Any, tensors: dict[str, Any]
            ) -> dict[str, Any]:
                on_step_end(step_index + 1, total())
                return tensors

            return {"callback_on_step_end": on_step}
        if "callback" in self._call_params and "callback_steps" in self._call_params:

            def legacy(step_index: int, _timestep: Any, _latents: Any) -> None:
                on_step_end(step_index + 1, total())

            return {"callback": legacy, "callback_steps": 1}
        return {}  # no step hook: no progress and no early stop for this pipeline

    def _frames_of(self, result: Any, request: GenerationRequest) -> list[np.ndarray]:
        raw = getattr(result, "frames", None) if self.is_video else None
        if raw is None:
            raw = result.images
        batch = np.asarray(raw)
        if batch.ndim == 4:  # images (B, H, W, 3) -> one-frame videos
            batch = batch[:, None]
        if batch.dtype != np.uint8:
            batch = to_uint8(batch)
        produced = (batch.shape[1], batch.shape[2], batch.shape[3])
        wanted = (request.num_frames, request.height, request.width)
        if produced != wanted:
            raise JobFailed(
                f"{self.name} produced frames x height x width {produced}, asked for {wanted}"
            )
        return [np.ascontiguousarray(frames) for frames in batch]


def _check_compatible(requests: Sequence[GenerationRequest]) -> None:
    keys = {r.batch_key() for r in requests}
    if len(keys) > 1:
        raise ValueError(f"requests of one batch must share a batch_key, got {sorted(keys)}")
