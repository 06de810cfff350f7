"""Uploaded inputs: where a client's upload lands, the presigned PUT for it, and its check on use.

An upload's object key is `[<prefix>/]uploads/<owner>/<upload_id>`: the owner is the API key id
(`anonymous` with auth off), so a reference resolves only under its caller's own folder and one
key can never name another key's upload. S3 gets a presigned PUT that signs the content type
and length; the local store has no HTTP server, so the API serves an equivalent PUT route and
streams the body to the store: only to a slot it issued (`UploadSlots`, kept in Redis until the
slot expires), and never past the size the slot declared. Either way `checked_upload` looks again
(HEAD) when the upload is used: it must exist, and its size and content type must be within the
limits.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.common.media import UPLOAD_REF_PREFIX, valid_upload_id
from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import ObjectStoreError
from kiln.storage.keys import Keys
from kiln.storage.object_base import ObjectStore, StoredObject, check_key
from kiln.storage.s3_errors import s3_errors
from kiln.storage.s3_store import S3ObjectStore
from kiln.storage.settings import StorageSettings

if TYPE_CHECKING:
    import redis

UPLOADS_FOLDER = "uploads"
ANONYMOUS_OWNER = "anonymous"


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


@dataclass(frozen=True)
class IssuedSlot:
    """What a slot was issued for: the exact size and the content type of the body to PUT."""

    size: int
    content_type: str


class UploadSlots:
    """Slots the API issued for its own PUT (a local store), each kept until it expires.

    S3 checks a presigned PUT's expiry, size and type itself; the API's PUT for a local store
    looks the slot up here, so an id never issued, or expired, is refused.
    """

    def __init__(self, redis_client: redis.Redis[str], settings: StorageSettings) -> None:
        self.redis = redis_client
        self.keys = Keys(settings.redis_namespace)

    @redis_boundary
    def issue(self, key_id: str | None, upload_id: str, slot: IssuedSlot, expires_s: int) -> None:
        """Record the slot of `upload_id` for the caller `key_id` until `expires_s` from now."""
        value = json.dumps({"size": slot.size, "content_type": slot.content_type})
        self.redis.set(self.keys.upload_slot(upload_owner(key_id), upload_id), value, ex=expires_s)

    @redis_boundary
    def issued(self, key_id: str | None, upload_id: str) -> IssuedSlot | None:
        """The live slot of `upload_id` issued to `key_id`; None if never issued or expired."""
        if not valid_upload_id(upload_id):
            return None
        value = self.redis.get(self.keys.upload_slot(upload_owner(key_id), upload_id))
        if value is None:
            return None
        data = json.loads(value)
        return IssuedSlot(int(data["size"]), str(data["content_type"]))


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
