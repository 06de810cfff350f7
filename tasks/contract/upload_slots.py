"""`POST /v1/uploads` (docs/contract.md §2c): the slot a client asks for, and what it gets back."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.common.media import BATCH_CONTENT_TYPES, IMAGE_CONTENT_TYPES, UPLOAD_REF_PREFIX

UPLOADS_PATH = "/v1/uploads"
LOCAL_PUT_PATH = "/v1/uploads/local"  # the PUT the API serves for a local (file://) store
CONTENT_TYPES: dict[str, frozenset[str]] = {
    "image": IMAGE_CONTENT_TYPES,
    "batch": BATCH_CONTENT_TYPES,
}


class UploadRequest(BaseModel):
    """An upload slot asked for: what will be sent, how large, and for what."""

    model_config = ConfigDict(extra="forbid")

    content_type: str = Field(
        min_length=1,
        max_length=128,
        description="image: image/png, image/jpeg or image/webp; batch: application/x-ndjson, "
        "application/jsonl or text/plain.",
    )
    bytes: int = Field(ge=1, description="The exact size of the body that will be PUT.")
    purpose: Literal["image", "batch"] = "image"


class UploadSlotView(BaseModel):
    """Where to PUT the upload, with which headers, and how to name it afterwards."""

    upload_id: str
    ref: str = Field(description=f"What a job's image input names it by: {UPLOAD_REF_PREFIX}<id>.")
    key: str = Field(description="The object key it is stored under.")
    method: Literal["PUT"] = "PUT"
    url: str = Field(description="A presigned PUT (S3), or the API's own PUT for a local store.")
    headers: dict[str, str] = Field(description="Headers the PUT must carry, exactly.")
    expires_at: float = Field(description="Unix time after which the URL is refused.")
