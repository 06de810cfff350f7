"""The upload call of `KilnClient` (a mixin): a file or bytes to `POST /v1/uploads`, then the PUT.

The API answers with where to PUT: a presigned object-store URL (sent without the API key: the
signature is the credential) or, for a local store, the API's own PUT (sent with it). What comes
back names the upload in a job's image input: `view.ref` (`upload:<id>`).
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Any

import httpx

from kiln.tasks.contract.uploads import UPLOADS_PATH, UploadSlotView

UploadSource = str | Path | bytes
# Magic numbers of the formats an image input may have.
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))


class UploadFailed(RuntimeError):
    """The object store refused the PUT of an upload (the slot was granted)."""


def sniff_content_type(data: bytes, name: str | None = None) -> str:
    """The content type of an image by its first bytes, else by its file name."""
    for signature, content_type in _SIGNATURES:
        if data.startswith(signature):
            return content_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    guessed = mimetypes.guess_type(name)[0] if name else None
    return guessed or "application/octet-stream"


class UploadCalls:
    """The upload method of `KilnClient` (which provides `_http` and `_call`)."""

    _http: httpx.Client

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        raise NotImplementedError  # KilnClient's: sends, raises the API's errors

    def upload(
        self, source: UploadSource, *, content_type: str | None = None, purpose: str = "image"
    ) -> UploadSlotView:
        """Upload a file (path) or bytes; returns the slot, whose `ref` a job's input names."""
        name = None if isinstance(source, bytes) else str(source)
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        content_type = content_type or sniff_content_type(data, name)
        body = {"content_type": content_type, "bytes": len(data), "purpose": purpose}
        slot = UploadSlotView.model_validate(self._call("POST", UPLOADS_PATH, json=body).json())
        if slot.url.startswith(str(self._http.base_url)):
            self._call("PUT", slot.url, content=data, headers=slot.headers)
            return slot
        try:  # a presigned URL: no API key goes to the object store
            answer = httpx.put(slot.url, content=data, headers=slot.headers, timeout=60.0)
        except httpx.TransportError as exc:
            raise UploadFailed(f"PUT of upload {slot.upload_id} failed: {exc}") from exc
        if not answer.is_success:
            raise UploadFailed(f"PUT of upload {slot.upload_id}: HTTP {answer.status_code}")
        return slot
