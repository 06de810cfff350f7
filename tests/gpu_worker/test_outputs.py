"""Encoding frames: the bytes decode back to the right format, size and frame count."""

from __future__ import annotations

import io
import re
import subprocess
from pathlib import Path
from typing import Any

import imageio_ffmpeg
import numpy as np
import pytest
from PIL import Image

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.outputs import EncodedOutput, OutputSpec, encode


def gradient_frames(count: int, height: int, width: int) -> np.ndarray:
    """Smooth, distinct frames (codecs keep them recognisable; GIF keeps every one)."""
    ys, xs = np.mgrid[0:height, 0:width]
    frames = np.empty((count, height, width, 3), np.uint8)
    for index in range(count):
        frames[index, ..., 0] = (xs * 255 // max(width - 1, 1) + index * 16) % 256
        frames[index, ..., 1] = ys * 255 // max(height - 1, 1)
        frames[index, ..., 2] = (index * 40) % 256
    return frames


def decode_video(encoded: EncodedOutput, tmp_path: Path) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The video stream's codec, size and fps as ffmpeg reads them, and its frames as RGB.

    Not `imageio_ffmpeg.read_frames`: when ffmpeg exits before the generator ends, it leaves
    ffmpeg's pipes open (a ResourceWarning).
    """
    path = tmp_path / f"video.{encoded.extension}"
    path.write_bytes(encoded.data)
    ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
    # With no output named, ffmpeg prints the input's header and exits non-zero.
    header = subprocess.run(
        [ffmpeg, "-hide_banner", "-i", str(path)], capture_output=True, text=True, check=False
    ).stderr
    stream = next(line for line in header.splitlines() if " Video: " in line)
    size = re.search(r", (\d+)x(\d+)", stream)
    assert size is not None, stream
    fps = re.search(r", ([\d.]+) fps", stream)
    width, height = int(size[1]), int(size[2])
    meta = {
        "codec": stream.split(" Video: ", 1)[1].split()[0],
        "size": (width, height),
        "fps": float(fps[1]) if fps else None,
    }
    raw = subprocess.run(
        [ffmpeg, "-v", "error", "-i", str(path), "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
        capture_output=True,
        check=True,
    ).stdout
    return meta, list(np.frombuffer(raw, np.uint8).reshape(-1, height, width, 3))


@pytest.mark.parametrize(
    ("fmt", "pil_format", "content_type", "extension"),
    [
        ("png", "PNG", "image/png", "png"),
        ("jpeg", "JPEG", "image/jpeg", "jpg"),
        ("webp", "WEBP", "image/webp", "webp"),
    ],
)
def test_images(fmt: str, pil_format: str, content_type: str, extension: str) -> None:
    image = gradient_frames(1, 40, 72)
    encoded = encode(image, OutputSpec(fmt))
    assert (encoded.content_type, encoded.extension) == (content_type, extension)
    assert (encoded.width, encoded.height, encoded.frames) == (72, 40, 1)
    decoded = Image.open(io.BytesIO(encoded.data))
    assert decoded.format == pil_format
    assert decoded.size == (72, 40)
    pixels = np.asarray(decoded.convert("RGB"))
    if fmt == "png":
        assert np.array_equal(pixels, image[0])  # lossless
    else:
        assert np.abs(pixels.astype(int) - image[0].astype(int)).mean() < 8


def test_a_single_hwc_image_is_accepted() -> None:
    encoded = encode(gradient_frames(1, 16, 16)[0], OutputSpec("png"))
    assert (encoded.width, encoded.height, encoded.frames) == (16, 16, 1)


def test_jpeg_quality_changes_the_size() -> None:
    image = gradient_frames(1, 64, 64)
    low = encode(image, OutputSpec("jpeg", quality=10))
    high = encode(image, OutputSpec("jpeg", quality=95))
    assert len(low.data) < len(high.data)


def test_mp4_is_h264_yuv420p_with_the_index_first(tmp_path: Path) -> None:
    frames = gradient_frames(12, 64, 80)
    encoded = encode(frames, OutputSpec("mp4", fps=12))
    assert (encoded.content_type, encoded.extension) == ("video/mp4", "mp4")
    assert (encoded.width, encoded.height, encoded.frames) == (80, 64, 12)
    # +faststart: the moov atom (the index) precedes the media data.
    assert 0 <= encoded.data.find(b"moov") < encoded.data.find(b"mdat")
    meta, decoded = decode_video(encoded, tmp_path)
    assert meta["codec"] == "h264"
    assert meta["size"] == (80, 64)
    assert meta["fps"] == 12
    assert len(decoded) == 12
    assert np.abs(decoded[5].astype(int) - frames[5].astype(int)).mean() < 10


def test_sizes_not_divisible_by_16_are_not_resized(tmp_path: Path) -> None:
    frames = gradient_frames(4, 40, 72)  # imageio would rescale this to 48x80 by default
    encoded = encode(frames, OutputSpec("mp4"))
    meta, _ = decode_video(encoded, tmp_path)
    assert meta["size"] == (72, 40) == (encoded.width, encoded.height)


def test_odd_sizes_get_one_replicated_edge_and_say_so(tmp_path: Path) -> None:
    frames = gradient_frames(3, 37, 51)
    encoded = encode(frames, OutputSpec("mp4"))
    meta, decoded = decode_video(encoded, tmp_path)
    assert meta["size"] == (52, 38) == (encoded.width, encoded.height)
    assert len(decoded) == 3


def test_webm_is_vp9(tmp_path: Path) -> None:
    encoded = encode(gradient_frames(6, 48, 64), OutputSpec("webm", fps=8))
    assert (encoded.content_type, encoded.extension) == ("video/webm", "webm")
    assert encoded.data[:4] == b"\x1a\x45\xdf\xa3"  # EBML (Matroska/WebM) magic
    meta, decoded = decode_video(encoded, tmp_path)
    assert meta["codec"] == "vp9"
    assert meta["size"] == (64, 48)
    assert len(decoded) == 6


def test_gif_keeps_every_frame() -> None:
    encoded = encode(gradient_frames(5, 30, 50), OutputSpec("gif", fps=10))
    assert (encoded.content_type, encoded.extension, encoded.frames) == ("image/gif", "gif", 5)
    decoded = Image.open(io.BytesIO(encoded.data))
    assert decoded.format == "GIF"
    assert decoded.size == (50, 30)
    assert getattr(decoded, "n_frames", 1) == 5
    assert decoded.info["duration"] == 100


@pytest.mark.parametrize("fmt", ["mp4", "webm", "gif"])
def test_a_video_format_needs_frames(fmt: str) -> None:
    with pytest.raises(UnsupportedRequest, match=r"^output_format: .*2 or more frames"):
        encode(gradient_frames(1, 16, 16), OutputSpec(fmt))


def test_an_image_format_holds_one_frame() -> None:
    with pytest.raises(UnsupportedRequest, match=r"^output_format: png holds one image"):
        encode(gradient_frames(3, 16, 16), OutputSpec("png"))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"format": "bmp"}, "output_format"),
        ({"format": "mp4", "fps": 0}, "fps"),
        ({"format": "jpeg", "quality": 101}, "quality"),
    ],
)
def test_bad_specs_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedRequest, match=f"^{field}:"):
        OutputSpec(**spec)


@pytest.mark.parametrize(
    "frames",
    [
        np.zeros((2, 8, 8, 3), np.float32),
        np.zeros((2, 8, 8, 4), np.uint8),
        np.zeros((0, 8, 8, 3), np.uint8),
        np.zeros((8, 8), np.uint8),
    ],
)
def test_malformed_frames_are_a_programming_error(frames: np.ndarray) -> None:
    with pytest.raises(ValueError, match="frames must be"):
        encode(frames, OutputSpec("png"))
