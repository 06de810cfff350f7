"""What both object stores share: the key builder, key checks, StoredObject, the protocol."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kiln.storage.errors import InvalidObjectKey
from kiln.storage.keys import valid_id

# fullmatch everywhere: `$` would let a trailing newline through
_SEGMENT = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]*")
_EXT = re.compile(r"[A-Za-z0-9]{1,16}")
_METADATA_KEY = re.compile(r"[a-z0-9][a-z0-9_\-]{0,63}")
# an attempt's folder: its lease token, then a nonce (a token alone could repeat after a Redis
# that lost its data; a collision is refused anyway by the create-only put)
_ATTEMPT = re.compile(r"[0-9]{1,19}-[0-9a-f]{8}")
# the stores keep the content's sha256 under this user-metadata key
SHA256_METADATA_KEY = "sha256"
STREAM_CHUNK = 256 * 1024  # what a store's streamed read hands on at a time


def check_prefix(prefix: str) -> str:
    """Return `prefix` if it is '' or plain `a/b/c` segments (no '..', no leading '/')."""
    if prefix and not all(
        _SEGMENT.fullmatch(part) and part not in {".", ".."} for part in prefix.split("/")
    ):
        raise InvalidObjectKey(f"invalid prefix {prefix!r}")
    return prefix


def new_attempt_name(lease_token: int) -> str:
    """A fresh attempt folder name, `{lease_token}-{8 hex}`: one per attempt of a job."""
    if isinstance(lease_token, bool) or not isinstance(lease_token, int) or lease_token < 0:
        raise InvalidObjectKey(f"invalid lease token {lease_token!r}")
    return f"{lease_token}-{secrets.token_hex(4)}"


def attempt_folder(prefix: str, job_id: str, attempt: str) -> str:
    """`{prefix}/{job_id}/{attempt}`: the folder only that attempt of the job writes in."""
    check_prefix(prefix)
    if not valid_id(job_id):
        raise InvalidObjectKey(f"invalid job id {job_id!r}")
    if not isinstance(attempt, str) or not _ATTEMPT.fullmatch(attempt):
        raise InvalidObjectKey(f"invalid attempt name {attempt!r}")
    name = f"{job_id}/{attempt}"
    return f"{prefix}/{name}" if prefix else name


def output_key(prefix: str, job_id: str, index: int, ext: str, *, attempt: str) -> str:
    """`{prefix}/{job_id}/{attempt}/{index}.{ext}`: the only way Kiln names an output.

    Each attempt writes under its own folder (`new_attempt_name`), so an attempt that lost its
    lease can never overwrite the outputs another attempt committed. Refuses escapes.
    """
    folder = attempt_folder(prefix, job_id, attempt)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise InvalidObjectKey(f"invalid output index {index!r}")
    if not _EXT.fullmatch(ext):
        raise InvalidObjectKey(f"invalid extension {ext!r}")
    return f"{folder}/{index}.{ext}"


def preview_key(prefix: str, job_id: str, ext: str) -> str:
    """`{prefix}/{job_id}/preview.{ext}`: a job's newest large preview, replaced by the next one.

    Outside every attempt's folder: it is no output, and a job has at most one.
    """
    check_prefix(prefix)
    if not valid_id(job_id):
        raise InvalidObjectKey(f"invalid job id {job_id!r}")
    if not _EXT.fullmatch(ext):
        raise InvalidObjectKey(f"invalid extension {ext!r}")
    name = f"{job_id}/preview.{ext}"
    return f"{prefix}/{name}" if prefix else name


def check_key(prefix: str, key: str) -> str:
    """Return `key` if it lies under `prefix` and has only plain segments; else InvalidObjectKey."""
    parts = key.split("/")
    if not key or not all(_SEGMENT.fullmatch(p) and p not in {".", ".."} for p in parts):
        raise InvalidObjectKey(f"invalid object key {key!r}")
    if prefix and not key.startswith(prefix + "/"):
        raise InvalidObjectKey(f"object key {key!r} is outside prefix {prefix!r}")
    return key


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    """Return `metadata` if its keys are lowercase tokens and values ASCII (what S3 keeps)."""
    for name, value in metadata.items():
        if not _METADATA_KEY.fullmatch(name) or name == SHA256_METADATA_KEY:
            raise ValueError(f"invalid or reserved metadata key {name!r}")
        if not isinstance(value, str) or not value.isascii():
            raise ValueError(f"metadata value for {name!r} must be an ASCII string")
    return metadata


@dataclass(frozen=True)
class StoredObject:
    """An object as stored: key, size in bytes, hex sha256, content type, user metadata."""

    key: str
    size: int
    sha256: str
    content_type: str
    metadata: dict[str, str] = field(default_factory=dict)
    # set by a put only: the store checked `sha256` against the bytes it received and confirmed
    # it in its answer (S3 echoes the ChecksumSHA256 it verified), so no read-back is needed
    checksum_verified: bool = False


class ObjectStore(Protocol):
    """Where outputs are written; keys come from output_key(store.prefix, ..., attempt=...)."""

    prefix: str

    def put(
        self,
        key: str,
        data: bytes,
        content_type: str,
        metadata: dict[str, str] | None = None,
        *,
        create_only: bool = False,
    ) -> StoredObject:
        """Write `data` under `key`; returns what was stored.

        An existing object is replaced, unless `create_only`: then ObjectExists, and the stored
        object is left as it was (S3 `If-None-Match: *`; an exclusive create on the local store).
        """
        ...

    def head(self, key: str) -> StoredObject | None:
        """What is stored under `key`, or None."""
        ...

    def get(self, key: str) -> bytes:
        """The bytes under `key`; ObjectNotFound if none."""
        ...

    def delete(self, key: str) -> None:
        """Remove `key` (no error if absent)."""
        ...

    def list_keys(self, folder: str) -> Iterator[str]:
        """Every key under `folder/` (a key inside the prefix, as a folder), in key order."""
        ...

    def url(self, key: str, expires_s: int | None = None) -> str:
        """A URL a client can download `key` from (presigned for S3, file:// for local)."""
        ...
