"""Input images as the ranks receive them: the encoded bytes, named by their sha256.

The node fetches or reads each image input, checks it (type, size, pixel count) and hands the
encoded bytes over in `GenerationRequest.images`; in `extra_inputs` the reference is replaced by
`sha256:<hex>`, so requests batch together only with the same image bytes. Ranks decode the
bytes with PIL where the pipeline is called (decoding is deterministic: every rank sees the same
pixels).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image

SHA256_PREFIX = "sha256:"


@dataclass(frozen=True)
class InputImage:
    """One encoded input image (PNG, JPEG or WebP) and what identifies it."""

    sha256: str
    data: bytes
    width: int
    height: int

    @property
    def ref(self) -> str:
        """What `extra_inputs` holds in place of the reference: `sha256:<hex>`."""
        return f"{SHA256_PREFIX}{self.sha256}"

    def to_pil(self, size: tuple[int, int] | None = None) -> Image.Image:
        """The pixels as an RGB image, resized to `size` (width, height) when given."""
        with Image.open(io.BytesIO(self.data)) as opened:
            image = opened.convert("RGB")
        if size is not None and image.size != size:
            image = image.resize(size, Image.Resampling.LANCZOS)
        return image
