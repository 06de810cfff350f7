"""Any diffusers `DiffusionPipeline` (text or image to image or video) behind Kiln's `Pipeline`.

Loaded with `from_pretrained` from a local folder or a hub id; `HF_HUB_OFFLINE=1` is honoured by
huggingface_hub itself, so a worker that must not touch the network sets it in its environment.
What a request may ask is checked here (`validate`); how a batch becomes one call is
`diffusers_call.py`, what the pipeline takes `diffusers_inputs.py`, its default limits and
geometry `diffusers_limits.py`, the scheduler swap `diffusers_schedulers.py`.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Sequence
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers import DiffusionPipeline

from kiln.common.limits import DeclaredLimits
from kiln.common.request import SPEED_KEY, InputSchema
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.inputs import extra_inputs_refusal
from kiln.gpu_worker.pipeline_specs import TINY_VARIANTS, one_line
from kiln.gpu_worker.pipelines.base import StepCallback
from kiln.gpu_worker.pipelines.diffusers_call import (
    LatentsHook,
    batch_kwargs,
    extra_kwargs,
    output_seed,
    result_frames,
    split_per_request,
    step_hook_kwargs,
)
from kiln.gpu_worker.pipelines.diffusers_inputs import derive_input_schema
from kiln.gpu_worker.pipelines.diffusers_limits import (
    derive_limits,
    find_denoiser,
    size_multiple,
    temporal_factor,
)
from kiln.gpu_worker.pipelines.diffusers_resume import (
    RESUMABLE_PIPELINES,
    Checkpointing,
    capture_state,
    request_digest,
    resumable_refusal,
    resuming,
    scheduler_identity,
    weights_fingerprint,
)
from kiln.gpu_worker.pipelines.diffusers_schedulers import SchedulerChoice
from kiln.gpu_worker.pipelines.image_pipelines import image_call_kwargs, missing_image
from kiln.gpu_worker.pipelines.lora import AdapterCache, no_adapters
from kiln.gpu_worker.pipelines.signature_kinds import call_parameters
from kiln.gpu_worker.pipelines.step_checkpoint import NotCheckpointable
from kiln.gpu_worker.protocol import GenerationRequest, SpeedReport
from kiln.gpu_worker.speed import SPEED_THRESHOLDS, applied_speed, speed_modes, speed_refusal

log = logging.getLogger(__name__)

__all__ = ["DiffusersPipeline", "default_dtype", "output_seed"]

# Fields every wrapped pipeline honours; the others depend on the pipeline's `__call__`.
_BASE_FIELDS = frozenset(
    {"request_id", "pipeline", "prompt", "width", "height", "steps", "seed", "num_outputs"}
)


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (float16 where bf16 is unsupported), float32 on CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


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
        self._schedulers = SchedulerChoice(pipe)
        self._schema: InputSchema | None = None
        self.adapters: AdapterCache = no_adapters(pipe)  # the loader gives the node's adapters
        # Speed modes (gpu_worker/speed.py): those the denoiser's cache hook serves, the cache
        # threshold of each, and what the last forward ran.
        self.speed_modes = speed_modes(pipe, self.denoiser())
        self.speed_thresholds = dict(SPEED_THRESHOLDS)
        self.last_speed: SpeedReport | None = None
        self._fingerprint: str | None = None  # weights_fingerprint, taken when first needed

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
        try:
            pipe = DiffusionPipeline.from_pretrained(source, dtype=dtype or default_dtype(device))
        except OSError as exc:  # said in one line by the rank: the cause must be in that line
            raise OSError(load_error_text(exc)) from exc
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, device, name or f"diffusers:{source}", limits)

    def as_variant(self, spec: str) -> DiffusersPipeline:
        """These components behind the class the tiny variant `spec` names; `self` otherwise.

        `tiny-img2img` and `tiny-inpaint` are the `tiny` pipeline's own components (the same
        folder in the model cache, no other weights) behind diffusers'
        `StableDiffusionImg2ImgPipeline` and `StableDiffusionInpaintPipeline`; `tiny-i2v` is
        `tiny-video`'s components behind `WanImageToVideoPipeline` in its Wan 2.2 form
        (`expand_timesteps`: the image's latents become the first latent frame, so no image
        encoder and no wider transformer are needed).
        """
        if spec not in TINY_VARIANTS:
            return self
        _, class_name, options = TINY_VARIANTS[spec]
        cls = getattr(diffusers, class_name)
        takes = inspect.signature(cls.__init__).parameters
        components = {k: v for k, v in self.pipe.components.items() if k in takes}
        pipe = cls(**components, **options)
        pipe.set_progress_bar_config(disable=True)
        return DiffusersPipeline(pipe, self.device, spec, self.limits())

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
        temporal = temporal_factor(self.pipe) if self.is_video else None
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
                schedulers=self._schedulers.names(),
            )
            self._schema[SPEED_KEY] = list(self.speed_modes)
        return self._schema

    def validate(self, request: GenerationRequest) -> None:
        """Raise `UnsupportedRequest` naming the field the pipeline cannot serve as asked."""
        self.adapters.check(request)
        refusal = extra_inputs_refusal(self.name, self.input_schema(), request.extra_inputs)
        refusal = refusal or missing_image(self.name, self.input_schema(), request)
        refusal = refusal or self._schedulers.refusal(request.extra_inputs)
        refusal = refusal or speed_refusal(self.name, self.speed_modes, request.speed)
        if refusal is not None:
            raise UnsupportedRequest(refusal)
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
        temporal = temporal_factor(self.pipe)
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise UnsupportedRequest(
                f"num_frames: {num_frames} must be {temporal}*k + 1 for {self.name}"
            )

    def _size_multiple(self) -> int:
        return size_multiple(self.pipe, self.denoiser())

    def denoiser(self) -> torch.nn.Module | None:
        """The per-step module: the pipeline's transformer, else its unet."""
        return find_denoiser(self.pipe)

    def takes_checkpoints(self) -> bool:
        """Whether its loop is one Kiln resumes (a run of one job then takes checkpoints)."""
        return type(self.pipe).__name__ in RESUMABLE_PIPELINES

    def checkpoint_refusal(self, requests: Sequence[GenerationRequest]) -> str | None:
        """Why a run of `requests` cannot take step checkpoints; None when it can."""
        return resumable_refusal(self.pipe, requests)

    def checkpoint_identity(self, request: GenerationRequest) -> dict[str, str]:
        """What a checkpoint of `request` must have been made by to be resumed here.

        The weights (`weights_fingerprint`, taken once, before any LoRA is applied), the dtype,
        the LoRA set, the speed mode, the scheduler (class and config) the request runs, and
        the request's own computing fields.
        """
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.pipe.components)
        denoiser = self.denoiser()
        dtype = next(denoiser.parameters()).dtype if denoiser is not None else None
        with self._schedulers.applied(request.extra_inputs):
            scheduler = scheduler_identity(self.pipe.scheduler)
        return {
            "pipeline": self.name,
            "pipeline_class": type(self.pipe).__name__,
            "weights": self._fingerprint,
            "dtype": str(dtype),
            "loras": json.dumps([[lora.name, lora.scale] for lora in request.loras]),
            "speed": request.speed,
            "scheduler": scheduler,
            "request": request_digest(request),
        }

    def run(
        self,
        requests: Sequence[GenerationRequest],
        on_step_end: StepCallback,
        *,
        checkpointing: Checkpointing | None = None,
    ) -> list[list[np.ndarray]]:
        """One forward for a batch of compatible requests; per request, per output, (F,H,W,3).

        With `checkpointing` (a batch `checkpoint_refusal` allows), the run starts from its
        `resume` state and hands a `DenoiseState` to its `sink` after each step it says is due.
        """
        if not requests:
            return []
        _check_compatible(requests)
        for request in requests:  # never let diffusers silently round a size or frame count
            self.validate(request)
        if checkpointing is not None and (refusal := self.checkpoint_refusal(requests)):
            raise ValueError(f"no step checkpoints for this run: {refusal}")
        kwargs = self._call_kwargs(requests, on_step_end, checkpointing)
        first = requests[0]
        self.last_speed = None
        with (
            self.adapters.applied(first),  # outside inference mode: it changes weights
            torch.inference_mode(),
            self._schedulers.applied(first.extra_inputs),
            applied_speed(
                self.denoiser(), first.speed, self.device, self.speed_thresholds
            ) as speed,
            resuming(self.pipe, checkpointing or Checkpointing(), kwargs["generator"], self.device),
        ):
            result = self.pipe(**kwargs)
        self.last_speed = speed.report()
        frames = result_frames(result, first, is_video=self.is_video, name=self.name)
        return split_per_request(requests, frames)

    def _call_kwargs(
        self,
        requests: Sequence[GenerationRequest],
        on_step_end: StepCallback,
        checkpointing: Checkpointing | None = None,
    ) -> dict[str, Any]:
        first = requests[0]
        kwargs = batch_kwargs(requests, self._call_params, is_video=self.is_video)
        kwargs.update(extra_kwargs(self.input_schema(), first.extra_inputs))
        outputs = sum(request.num_outputs for request in requests)
        kwargs = image_call_kwargs(
            kwargs, first, self.input_schema(), self._call_params, outputs=outputs
        )
        after_step = None
        if checkpointing is not None and checkpointing.sink is not None:
            after_step = self._capture_hook(first, checkpointing, kwargs["generator"])
        kwargs.update(
            step_hook_kwargs(self.pipe, self._call_params, first.steps, on_step_end, after_step)
        )
        return kwargs

    def _capture_hook(
        self,
        request: GenerationRequest,
        checkpointing: Checkpointing,
        generators: list[torch.Generator],
    ) -> LatentsHook:
        identity = self.checkpoint_identity(request)
        sink = checkpointing.sink
        assert sink is not None

        def after_step(done: int, total: int, latents: torch.Tensor) -> None:
            # the last step's state is the output itself: nothing left to resume
            if done >= total or not checkpointing.due(done, total):
                return
            try:
                state = capture_state(
                    identity, done, total, latents, self.pipe.scheduler, generators
                )
            except NotCheckpointable as exc:  # a checkpoint never fails the job
                log.warning("no step checkpoint after step %d: %s", done, exc)
                return
            sink(state)

        return after_step


def load_error_text(exc: OSError) -> str:
    """A loading error and its root cause in one line, without diffusers' "stacktrace above"."""
    text = " ".join(str(exc).replace(_SEE_ABOVE, "").split())
    root: BaseException = exc
    for _ in range(16):  # the chain's end (bounded: nothing stops a chain from looping)
        linked = root.__cause__ or root.__context__
        if linked is None:
            break
        root = linked
    if root is not exc and type(root).__name__ not in text:
        text += f" (cause: {one_line(root)})"
    return text


# diffusers ends a hub error so, pointing at the traceback a one-line report does not show
_SEE_ABOVE = "Please check out the root cause in the stacktrace above."


def _check_compatible(requests: Sequence[GenerationRequest]) -> None:
    keys = {r.batch_key() for r in requests}
    if len(keys) > 1:
        raise ValueError(f"requests of one batch must share a batch_key, got {sorted(keys)}")
