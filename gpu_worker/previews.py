"""Previews while denoising: the current latents of a request, decoded cheaply on rank 0.

The decoder, chosen per pipeline when rank 0 starts leading (`build_decoders`):
- the one the pipeline names through the protocol's preview hook (`preview_decoder()`; its `run`
  hands over its latents with `report_latents`, docs/pipelines.md), whatever else it has;
- else, for a pipeline with a diffusers `pipe.vae`, a tiny autoencoder (diffusers
  `AutoencoderTiny`: TAESD, TAESDXL, TAESD3, TAEF1 weights) from the folder `KILN_PREVIEW_VAE`
  names, for the pipelines whose latents have its channel count;
- otherwise a linear map latent channels (+ bias) → RGB, fitted by least squares to what the
  pipeline's own VAE decodes from a few random latents (`fit_linear_map`): any VAE, no weights.
A preview is the request's first output; a video's is its middle latent frame. The decoded
pixels (uint8, longer side ≤ the request's `max_side`) go to the coordinator unencoded
(`StepPreview`): encoding is the node's, off the denoising loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from kiln.common.previews import DEFAULT_PREVIEW_SIDE
from kiln.gpu_worker.pipelines.base import Pipeline
from kiln.gpu_worker.protocol import GenerationRequest, RunBatch, StepPreview

logger = logging.getLogger(__name__)

# The random latents decoded for the fit, one per scale: loop latents range from the initial
# noise (std = the scheduler's init_noise_sigma: ~14.6 for SD's Euler schedules, 1 for flow
# matching) down to the final image's (std ~1), so the fit spans that range, log-spaced.
FIT_SCALES = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
FIT_SIDE = 16  # their latent side: 6 × 16 × 16 = 1,536 pixel rows for C + 1 unknowns per colour


class LatentDecoder(Protocol):
    """Latents (1, C, h, w) as the denoising loop holds them → RGB (1, 3, H, W) in [-1, 1]."""

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode one latent image (any device; the result stays on it)."""
        ...


def to_vae_space(latents: torch.Tensor, config: Any) -> torch.Tensor:
    """Loop-space latents as a VAE's `decode` takes them (its scaling, shift, or mean/std)."""
    mean = getattr(config, "latents_mean", None)
    std = getattr(config, "latents_std", None)
    if mean is not None and std is not None and len(mean) == latents.shape[1]:
        shape = (1, latents.shape[1]) + (1,) * (latents.ndim - 2)
        mean_t = torch.tensor(mean, dtype=latents.dtype, device=latents.device).view(shape)
        std_t = torch.tensor(std, dtype=latents.dtype, device=latents.device).view(shape)
        return latents * std_t + mean_t  # Wan-style: the pipeline normalised per channel
    scaling = float(getattr(config, "scaling_factor", None) or 1.0)
    shift = float(getattr(config, "shift_factor", None) or 0.0)
    return latents / scaling + shift


@dataclass(frozen=True)
class LinearLatentMap:
    """RGB = weight · latent + bias per latent pixel; fitted to one VAE (`fit_linear_map`)."""

    weight: torch.Tensor  # (3, C), float32 on the CPU
    bias: torch.Tensor  # (3,)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, C, h, w) → (1, 3, h, w) at the latents' resolution, in their device and dtype."""
        weight = self.weight.to(latents.device, latents.dtype)
        bias = self.bias.to(latents.device, latents.dtype)
        count, channels, height, width = latents.shape
        # one matrix product and one add: this runs inside the denoising loop, every preview
        flat = latents.reshape(count, channels, height * width)
        rgb = torch.matmul(weight, flat).add_(bias.view(1, 3, 1))
        return rgb.view(count, 3, height, width)


def latent_channels(vae: Any) -> int:
    """Channels of `vae`'s latents: `latent_channels` (image VAEs), else `z_dim` (Wan's)."""
    return int(getattr(vae.config, "latent_channels", None) or vae.config.z_dim)


def fit_linear_map(vae: Any, *, seed: int = 0) -> LinearLatentMap:
    """Least squares from random loop-space latents to what `vae` decodes, pooled per latent pixel.

    Random normal latents at the scales denoising passes through (`FIT_SCALES`); the fit is the
    VAE decoder's linear part over them, which is what a latent→RGB preview needs (colours and
    layout, not detail).
    """
    channels = latent_channels(vae)
    video = hasattr(vae.config, "z_dim") and hasattr(vae.config, "temperal_downsample")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shape = (len(FIT_SCALES), channels, FIT_SIDE, FIT_SIDE)
    scales = torch.tensor(FIT_SCALES).view(-1, 1, 1, 1)
    latents = torch.randn(shape, generator=generator) * scales
    param = next(vae.parameters())
    with torch.inference_mode():
        vae_in = latents.unsqueeze(2) if video else latents  # one latent frame of a video VAE
        vae_in = to_vae_space(vae_in.to(param.device, param.dtype), vae.config)
        images = vae.decode(vae_in).sample.float().cpu()
    if images.ndim == 5:
        images = images[:, :, 0]
    pooled = F.adaptive_avg_pool2d(images, (FIT_SIDE, FIT_SIDE))  # (S, 3, side, side)
    inputs = latents.permute(0, 2, 3, 1).reshape(-1, channels)
    inputs = torch.cat([inputs, torch.ones(inputs.shape[0], 1)], dim=1)
    targets = pooled.permute(0, 2, 3, 1).reshape(-1, 3)
    solution = torch.linalg.lstsq(inputs, targets).solution  # (C + 1, 3)
    return LinearLatentMap(solution[:channels].T.contiguous(), solution[channels].contiguous())


class TinyAutoencoderDecoder:
    """A diffusers `AutoencoderTiny` (TAESD family) decoding loop-space latents."""

    def __init__(self, vae: Any) -> None:
        self.vae = vae
        self.latent_channels = int(vae.config.latent_channels)
        # where the latents go in: read once, not on every preview
        parameter = next(vae.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype

    @classmethod
    def load(cls, folder: Path, device: torch.device, dtype: torch.dtype) -> TinyAutoencoderDecoder:
        """`AutoencoderTiny.from_pretrained(folder)` on the device, in the pipeline's dtype."""
        from diffusers import AutoencoderTiny

        vae = AutoencoderTiny.from_pretrained(str(folder), torch_dtype=dtype).to(device)
        vae.eval()
        return cls(vae)

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        """(1, C, h, w) → (1, 3, H, W) in [-1, 1]."""
        vae_in = to_vae_space(latents.to(self.device, self.dtype), self.vae.config)
        decoded: torch.Tensor = self.vae.decode(vae_in).sample
        return decoded


def _pipeline_vae(pipeline: Pipeline) -> Any:
    return getattr(getattr(pipeline, "pipe", None), "vae", None)


def named_decoder(pipeline: object) -> LatentDecoder | None:
    """The decoder the pipeline names through its preview hook (`preview_decoder()`), or None."""
    name = getattr(pipeline, "preview_decoder", None)
    if name is None:
        return None
    decoder = name()
    if decoder is not None and not callable(decoder):
        raise TypeError(f"preview_decoder() returned {type(decoder).__name__}, not a callable")
    return decoder  # type: ignore[no-any-return]


def can_preview(pipeline: Pipeline) -> bool:
    """Whether rank 0 can decode previews of `pipeline`: a named decoder, or a VAE to fit one."""
    return named_decoder(pipeline) is not None or _pipeline_vae(pipeline) is not None


def build_decoders(
    pipelines: Mapping[str, Pipeline], tiny_folder: Path | None, device: torch.device
) -> dict[str, LatentDecoder]:
    """Per pipeline: the decoder it names, else (with a VAE) a tiny autoencoder or a fitted map.

    The tiny autoencoder where its channels fit the VAE's; none for a pipeline with neither (it
    announces no previews, `can_preview`).
    """
    tiny: TinyAutoencoderDecoder | None = None
    decoders: dict[str, LatentDecoder] = {}
    for name, pipeline in pipelines.items():
        try:
            named = named_decoder(pipeline)
        except Exception:  # best effort, as below: the pipeline still serves jobs
            logger.exception("previews of pipeline %s are off: preview_decoder() failed", name)
            continue
        if named is not None:
            decoders[name] = named
            continue
        vae = _pipeline_vae(pipeline)
        if vae is None:
            logger.info("pipeline %s has no VAE and names no preview decoder: no previews", name)
            continue
        try:
            if tiny_folder is not None and tiny is None:
                dtype = next(vae.parameters()).dtype
                tiny = TinyAutoencoderDecoder.load(tiny_folder, device, dtype)
            if tiny is not None and tiny.latent_channels == latent_channels(vae):
                decoders[name] = tiny
            else:
                decoders[name] = fit_linear_map(vae)
        except Exception:  # previews are best effort: a pipeline without them still serves jobs
            logger.exception("previews of pipeline %s are off: no decoder", name)
    return decoders


def preview_pixels(decoded: torch.Tensor, max_side: int) -> np.ndarray:
    """(1, 3, H, W) in [-1, 1] → uint8 (h, w, 3), shrunk (area) so its longer side ≤ max_side."""
    height, width = decoded.shape[-2:]
    scale = min(1.0, max_side / max(height, width))
    if scale < 1.0:
        size = (max(1, round(height * scale)), max(1, round(width * scale)))
        decoded = F.interpolate(decoded.float(), size=size, mode="area")
    if decoded.device.type == "cpu":  # numpy's few small ops cost less than torch's dispatch
        scaled = decoded[0].float().numpy() * 127.5 + 127.5
        as_bytes = np.rint(np.clip(scaled, 0, 255)).astype(np.uint8)
        return np.ascontiguousarray(as_bytes.transpose(1, 2, 0))
    # on an accelerator: the same arithmetic there, and only the bytes come to the host
    pixels = (decoded[0].float() * 127.5 + 127.5).clamp_(0, 255).round_().to(torch.uint8)
    return np.ascontiguousarray(pixels.permute(1, 2, 0).cpu().numpy())


def latent_image(latents: torch.Tensor, row: int) -> torch.Tensor | None:
    """Row `row` of a batch's latents as one latent image (1, C, h, w); a video's middle frame.

    None for layouts a preview cannot read (packed sequences, as Flux keeps them).
    """
    if latents.ndim == 4:
        return latents[row : row + 1]
    if latents.ndim == 5:  # (B, C, F, h, w)
        return latents[row : row + 1, :, latents.shape[2] // 2]
    return None


class PreviewTap:
    """Rank 0's previews of one batch: which requests want one at which step, sent on."""

    def __init__(
        self,
        batch: RunBatch,
        decoder: LatentDecoder,
        send: Callable[[StepPreview], None],
    ) -> None:
        self._batch_id = batch.batch_id
        self._decoder = decoder
        self._send = send
        self._wanted = _preview_rows(batch.requests)
        self._unreadable = False

    @property
    def wanted(self) -> bool:
        """True when some request of the batch asked for previews."""
        return bool(self._wanted)

    def observe(self, step: int, total: int, latents: torch.Tensor) -> None:
        """After `step`: decode and send the previews due now; a failure only stops previews."""
        if self._unreadable:
            return
        for request, row in self._wanted:
            assert request.preview is not None
            if not request.preview.due(step):
                continue
            try:
                image = latent_image(latents, row)
                if image is None:
                    self._unreadable = True
                    logger.info("latents of shape %s have no preview", tuple(latents.shape))
                    return
                with torch.inference_mode():
                    pixels = preview_pixels(self._decoder(image), request.preview.max_side)
            except Exception:
                self._unreadable = True
                logger.exception("preview of batch %d failed; no more for it", self._batch_id)
                return
            self._send(StepPreview(self._batch_id, request.request_id, step, total, pixels))


def _preview_rows(requests: Sequence[GenerationRequest]) -> list[tuple[GenerationRequest, int]]:
    """The requests that want previews, each with the latent row of its first output."""
    rows: list[tuple[GenerationRequest, int]] = []
    row = 0
    for request in requests:
        if request.preview is not None:
            rows.append((request, row))
        row += request.num_outputs
    return rows


class _LatentsKept:
    """A step callback that keeps what `report_latents` hands it (a `LatentsObserver`)."""

    def __init__(self) -> None:
        self.latents: torch.Tensor | None = None

    def __call__(self, step: int, total: int) -> None:
        del step, total

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Keep the latents of the latest step."""
        del step, total
        self.latents = latents.detach()


def check_preview_hook(pipeline: Pipeline, request: GenerationRequest) -> bool:
    """Whether `pipeline` emits previews; ValueError naming what is wrong with its preview hook.

    A pipeline that names a decoder is run on `request`: its `run` must hand its latents to
    `report_latents`, and the decoder must turn the first output's into RGB (1, 3, H, W).
    """
    decoder = named_decoder(pipeline)
    if decoder is None:
        return _pipeline_vae(pipeline) is not None
    kept = _LatentsKept()
    pipeline.run([request], kept)
    if kept.latents is None:
        raise ValueError(
            "preview_decoder() names a decoder but run() never called report_latents(on_step_end,"
            " step, total, latents): no preview would come"
        )
    image = latent_image(kept.latents, 0)
    if image is None:
        raise ValueError(
            f"report_latents got latents of shape {tuple(kept.latents.shape)}; expected "
            "(outputs, C, h, w) or (outputs, C, frames, h, w)"
        )
    with torch.inference_mode():
        decoded = decoder(image)
    if not isinstance(decoded, torch.Tensor) or decoded.ndim != 4 or decoded.shape[:2] != (1, 3):
        shape = tuple(decoded.shape) if isinstance(decoded, torch.Tensor) else type(decoded)
        raise ValueError(f"preview_decoder()'s decoder returned {shape}; expected (1, 3, H, W)")
    preview_pixels(decoded, DEFAULT_PREVIEW_SIDE)
    return True
