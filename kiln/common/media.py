"""Content types Kiln writes and takes, and how a request names an uploaded object.

An output format's media type and file extension, the content types an image input and a batch's
input file may be uploaded as, and the `upload:<upload_id>` reference (32 hex digits, what
`kiln.storage.uploaded_inputs.new_upload_id` draws).
"""

from __future__ import annotations

import re

# output format → (content type, file extension); the formats are kiln.common.request's
FORMAT_MEDIA: dict[str, tuple[str, str]] = {
    "png": ("image/png", "png"),
    "jpeg": ("image/jpeg", "jpg"),
    "webp": ("image/webp", "webp"),
    "mp4": ("video/mp4", "mp4"),
    "webm": ("video/webm", "webm"),
    "gif": ("image/gif", "gif"),
}

IMAGE_CONTENT_TYPES = frozenset({"image/png", "image/jpeg", "image/webp"})
# what a batch's input file may be uploaded as, and what Kiln stores a batch's input lines as
BATCH_CONTENT_TYPES = frozenset({"application/x-ndjson", "application/jsonl", "text/plain"})
BATCH_INPUT_CONTENT_TYPE = "application/x-ndjson"

UPLOAD_REF_PREFIX = "upload:"  # how a request names an upload: `upload:<upload_id>`
UPLOAD_ID = re.compile(r"[0-9a-f]{32}")  # 128 random bits, hex


def valid_upload_id(upload_id: str) -> bool:
    """True if `upload_id` has the form uploads are given (32 hex digits)."""
    return bool(UPLOAD_ID.fullmatch(upload_id))
