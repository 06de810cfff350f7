"""Uploaded inputs: where a client's upload lands, the presigned PUT for it, and its check on use.

An upload's object key is `[<prefix>/]uploads/<owner>/<upload_id>`: the owner is the API key id
(`anonymous` with auth off), so a reference resolves only under its caller's own folder and one
key can never name another key's upload. S3 gets a presigned PUT that signs the content type
and length; the local store has no HTTP server, so the API serves an equivalent PUT route and
writes through `LocalObjectStore.put`. Either way `checked_upload` looks again (HEAD) when the
upload is used: it must exist, and its size and content type must be within the limits.
"""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from kiln.storage.errors import ObjectStoreError
from kiln.storage.object_base import ObjectStore, StoredObject, check_key
from kiln.storage.s3_errors import s3_errors
from kiln.storage.s3_store import S3ObjectStore

UPLOADS_FOLDER = "uploads"
ANONYMOUS_OWNER = "anonymous"
UPLOAD_REF_PREFIX = "upload:"  # how a request names an upload: `upload:<upload_id>`
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")


class UploadRefused(ObjectStoreError):
    """An upload that cannot be used: unknown (or another key's), too large, of the wrong type."""

    retryable = False


@dataclass(frozen=True)
class UploadSlot:
    """Where and how to PUT one upload: the URL, the headers to send with it, until when."""

    upload_id: str
    key: str
    url: str
    expires_at: float
    headers: dict[str, str] = field(default_factory=dict)


def upload_owner(key_id: str | None) -> str:
    """The folder of a caller's uploads: its API key id, or `anonymous` with auth off."""
    return key_id or ANONYMOUS_OWNER


def new_upload_id() -> str:
    """A fresh upload id (128 random bits, hex): unguessable, safe in keys and URLs."""
    return secrets.token_hex(16)


def valid_upload_id(upload_id: str) -> bool:
    """True if `upload_id` has the form `new_upload_id` makes."""
    return bool(_UPLOAD_ID.fullmatch(upload_id))


def upload_key(prefix: str, key_id: str | None, upload_id: str) -> str:
    """The object key of `upload_id` for the caller `key_id` (InvalidObjectKey if malformed)."""
    if not valid_upload_id(upload_id):
        raise UploadRefused(f"malformed upload id {upload_id!r}")
    name = f"{UPLOADS_FOLDER}/{upload_owner(key_id)}/{upload_id}"
    return check_key(prefix, f"{prefix}/{name}" if prefix else name)


def resolve_upload(objects: ObjectStore, key_id: str | None, upload_ref: str) -> str:
    """The object key an upload reference (`upload:<id>` or the bare id) names for `key_id`.

    Only the caller's own folder is looked in; UploadRefused when the reference is malformed.
    Whether the object exists is `checked_upload`'s question.
    """
    upload_id = upload_ref.removeprefix(UPLOAD_REF_PREFIX)
    return upload_key(objects.prefix, key_id, upload_id)


def checked_upload(
    objects: ObjectStore, key: str, max_bytes: int, content_types: Collection[str]
) -> StoredObject:
    """The stored upload under `key`, if it is there and within the limits; else UploadRefused."""
    stored = objects.head(key)
    if stored is None:
        raise UploadRefused("no such upload for this API key (not uploaded yet, or expired)")
    if stored.size > max_bytes:
        raise UploadRefused(f"the upload is {stored.size} bytes, over the limit of {max_bytes}")
    content_type = stored.content_type.split(";")[0].strip().lower()
    if content_type not in content_types:
        allowed = ", ".join(sorted(content_types))
        raise UploadRefused(f"the upload is {content_type!r}; allowed: {allowed}")
    return stored


def presigned_slot(
    objects: ObjectStore,
    key: str,
    *,
    content_type: str,
    size: int,
    expires_s: int,
    local_url: str,
) -> UploadSlot:
    """The PUT for `key`: presigned on S3 (type and length signed), `local_url` otherwise."""
    upload_id = key.rsplit("/", 1)[-1]
    expires_at = time.time() + expires_s
    headers = {"Content-Type": content_type}
    if not isinstance(objects, S3ObjectStore):
        return UploadSlot(upload_id, key, local_url, expires_at, headers)
    params = {
        "Bucket": objects.bucket,
        "Key": key,
        "ContentType": content_type,
        "ContentLength": size,
    }
    with s3_errors(key):
        url = objects.client.generate_presigned_url(
            "put_object", Params=params, ExpiresIn=expires_s
        )
    return UploadSlot(upload_id, key, url, expires_at, headers)
