"""Frames -> encoded bytes: PNG/JPEG/WebP images, MP4 (H.264) / WebM (VP9) / GIF videos.

Images go through Pillow; MP4 and WebM through the ffmpeg that imageio-ffmpeg ships; GIF through
Pillow. Nothing is ever resized: imageio-ffmpeg's default 16-pixel macro-block rescale is turned
off, and the only change a video may get is one replicated edge row/column when yuv420p needs an
even size. The returned width/height are those of the encoded file.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from pathlib import Path

import imageio_ffmpeg
import numpy as np
from PIL import Image

from kiln.common.media import FORMAT_MEDIA
from kiln.common.request import IMAGE_FORMATS, VIDEO_FORMATS
from kiln.gpu_worker.errors import UnsupportedRequest

DEFAULT_IMAGE_QUALITY = 90
# quality None -> the codec's usual default CRF; 1..100 maps linearly onto the CRF range.
_CRF_RANGE = {"mp4": (51, 23), "webm": (63, 32)}  # (worst CRF, default CRF)


@dataclass(frozen=True)
class OutputSpec:
    """How to encode one output: format, frames per second (video), quality 1-100 or default."""

    format: str = "png"
    fps: int = 16
    quality: int | None = None

    def __post_init__(self) -> None:
        if self.format not in IMAGE_FORMATS and self.format not in VIDEO_FORMATS:
            known = "|".join([*IMAGE_FORMATS, *VIDEO_FORMATS])
            raise UnsupportedRequest(f"output_format: {self.format!r} is not one of {known}")
        if self.fps < 1:
            raise UnsupportedRequest(f"fps: must be at least 1, got {self.fps}")
        if self.quality is not None and not 1 <= self.quality <= 100:
            raise UnsupportedRequest(f"quality: must be within 1-100, got {self.quality}")

    @property
    def is_video(self) -> bool:
        """True for the formats that hold several frames."""
        return self.format in VIDEO_FORMATS


@dataclass(frozen=True)
class EncodedOutput:
    """One encoded output and what it holds."""

    data: bytes
    content_type: str
    extension: str
    width: int
    height: int
    frames: int


def encode(frames: np.ndarray, spec: OutputSpec) -> EncodedOutput:
    """Encode uint8 frames, (F, H, W, 3) or one (H, W, 3) image, as `spec` says."""
    video = _as_frames(frames)
    count, height, width = video.shape[:3]
    if not spec.is_video:
        if count != 1:
            raise UnsupportedRequest(
                f"output_format: {spec.format} holds one image, got {count} frames; "
                f"use one of {'|'.join(VIDEO_FORMATS)}"
            )
        content_type, extension = FORMAT_MEDIA[spec.format]
        data = encode_image(video[0], spec)
        return EncodedOutput(data, content_type, extension, width, height, 1)
    if count < 2:
        raise UnsupportedRequest(
            f"output_format: {spec.format} is a video format and needs 2 or more frames, got "
            f"{count}; use one of {'|'.join(IMAGE_FORMATS)} for a single image"
        )
    content_type, extension = FORMAT_MEDIA[spec.format]
    if spec.format == "gif":
        return EncodedOutput(
            frames_to_gif(video, spec.fps), content_type, extension, width, height, count
        )
    even = pad_to_even(video)
    data = frames_to_ffmpeg(even, spec)
    return EncodedOutput(data, content_type, extension, even.shape[2], even.shape[1], count)


def _as_frames(frames: np.ndarray) -> np.ndarray:
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8, got {frames.dtype}")
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ValueError(f"frames must be (frames, height, width, 3), got {frames.shape}")
    return np.ascontiguousarray(frames)


def encode_image(image: np.ndarray, spec: OutputSpec) -> bytes:
    """One (H, W, 3) uint8 image to PNG, JPEG or WebP bytes."""
    buffer = io.BytesIO()
    picture = Image.fromarray(image, mode="RGB")
    quality = spec.quality or DEFAULT_IMAGE_QUALITY
    if spec.format == "png":
        picture.save(buffer, format="PNG")
    elif spec.format == "jpeg":
        picture.save(buffer, format="JPEG", quality=quality)
    else:
        picture.save(buffer, format="WEBP", quality=quality, lossless=spec.quality == 100)
    return buffer.getvalue()


def frames_to_gif(frames: np.ndarray, fps: int) -> bytes:
    """An endlessly looping GIF; Pillow's frame merging is off so every frame is kept."""
    pictures = [Image.fromarray(frame, mode="RGB") for frame in frames]
    buffer = io.BytesIO()
    pictures[0].save(
        buffer,
        format="GIF",
        save_all=True,
        append_images=pictures[1:],
        duration=round(1000 / fps),
        loop=0,
        optimize=False,
        disposal=1,
    )
    return buffer.getvalue()


def pad_to_even(frames: np.ndarray) -> np.ndarray:
    """Replicate the last row/column where height/width is odd (yuv420p needs even sizes)."""
    pad_h = frames.shape[1] % 2
    pad_w = frames.shape[2] % 2
    if not pad_h and not pad_w:
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def _crf(spec: OutputSpec) -> int:
    worst, default = _CRF_RANGE[spec.format]
    if spec.quality is None:
        return default
    return round(worst * (100 - spec.quality) / 99)


def frames_to_ffmpeg(frames: np.ndarray, spec: OutputSpec) -> bytes:
    """MP4 (libx264, yuv420p, moov atom first) or WebM (VP9) bytes of even-sized frames."""
    if spec.format == "mp4":
        codec = "libx264"
        params = ["-crf", str(_crf(spec)), "-movflags", "+faststart"]
    else:
        codec = "libvpx-vp9"
        params = ["-crf", str(_crf(spec)), "-b:v", "0", "-deadline", "realtime", "-cpu-used", "8"]
    height, width = frames.shape[1:3]
    # ffmpeg writes to a real file: +faststart rewrites the file to move the index to the front.
    with tempfile.TemporaryDirectory(prefix="kiln-encode-") as folder:
        path = Path(folder) / f"out.{spec.format}"
        writer = imageio_ffmpeg.write_frames(
            str(path),
            (width, height),
            fps=spec.fps,
            codec=codec,
            pix_fmt_out="yuv420p",
            quality=None,
            macro_block_size=1,
            output_params=params,
            ffmpeg_log_level="error",
        )
        writer.send(None)  # start the generator
        for frame in frames:
            writer.send(frame)
        writer.close()
        return path.read_bytes()
