"""Image references in a request's `inputs` (docs/contract.md §2c): their two forms, checked.

An image input (`x-kiln-image` in the pipeline's schema) is a string: `upload:<upload_id>` (an
object uploaded through `POST /v1/uploads` by the same API key) or an `https://` URL (`http://`
with `KILN_INPUT_ALLOW_HTTP`), which the node fetches through the SSRF guard. Torch-free: the API
checks the form here; who owns an upload is the API's question (`storage.uploaded_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kiln.common.media import UPLOAD_REF_PREFIX, valid_upload_id

UPLOAD_PURPOSES = ("image", "batch")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: an upload id, or a URL to fetch."""

    kind: Literal["upload", "url"]
    target: str  # the upload id, or the URL

    @property
    def text(self) -> str:
        """The reference as a request gives it: `upload:<upload_id>`, or the URL."""
        return f"{UPLOAD_REF_PREFIX}{self.target}" if self.kind == "upload" else self.target


def parse_image_ref(value: object) -> ImageRef:
    """The reference `value` holds; ValueError (the message says what is wrong) otherwise."""
    if not isinstance(value, str):
        raise ValueError("an image input is a string: upload:<upload_id> or an https:// URL")
    if value.startswith(UPLOAD_REF_PREFIX):
        upload_id = value[len(UPLOAD_REF_PREFIX) :]
        if not valid_upload_id(upload_id):
            raise ValueError(f"{value!r} is not upload:<upload_id> (32 hex digits)")
        return ImageRef("upload", upload_id)
    parts = urlsplit(value)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(
            f"{value[:64]!r} is neither upload:<upload_id> (POST /v1/uploads) nor an https:// URL"
        )
    return ImageRef("url", value)
