"""Streamed object I/O for batch files: write without holding the whole object, read from an offset.

A batch input can be far larger than memory, so it is written through an `ObjectWriter` (S3: a
multipart upload whose parts are sent as they fill; a local store: a temporary file renamed into
place on commit) and read back in ranges (`read_range`) or line by line (`iter_lines`). Keys of a
batch's objects are named by `batch_object_key`, under `{prefix}/batches/{batch id}/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from kiln.storage.errors import InvalidObjectKey, ObjectNotFound, ObjectStoreError
from kiln.storage.keys import valid_id
from kiln.storage.local_store import LocalObjectStore
from kiln.storage.object_base import (
    SHA256_METADATA_KEY,
    ObjectStore,
    StoredObject,
    check_key,
    check_prefix,
)
from kiln.storage.s3_errors import s3_errors
from kiln.storage.s3_store import S3ObjectStore

MIB = 1024 * 1024
# S3 parts must be at least 5 MiB (all but the last); one part is what a writer holds in memory
PART_SIZE = 8 * MIB
READ_CHUNK = 256 * 1024
BATCHES_FOLDER = "batches"


def batch_object_key(prefix: str, batch_id: str, *names: str) -> str:
    """`{prefix}/batches/{batch_id}/{names...}`: where a batch's input and results live."""
    check_prefix(prefix)
    if not valid_id(batch_id):
        raise InvalidObjectKey(f"invalid batch id {batch_id!r}")
    key = "/".join((BATCHES_FOLDER, batch_id, *names))
    full = f"{prefix}/{key}" if prefix else key
    return check_key(prefix, full)


class ObjectWriter(Protocol):
    """An object being written in pieces; nothing is visible under its key before `commit`."""

    key: str

    def write(self, data: bytes) -> None:
        """Append `data` (sent on as parts fill)."""
        ...

    def commit(self) -> StoredObject:
        """Finish the object; it is then readable under `key`."""
        ...

    def abort(self) -> None:
        """Drop what was written (no error if nothing was)."""
        ...


class _S3Writer:
    """A multipart upload that starts once a part is full; a small object is one PUT."""

    def __init__(self, store: S3ObjectStore, key: str, content_type: str) -> None:
        self.store = store
        self.key = check_key(store.prefix, key)
        self.content_type = content_type
        self._buffer = bytearray()
        self._digest = hashlib.sha256()
        self._size = 0
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def write(self, data: bytes) -> None:
        """Buffer `data`; send every full part."""
        self._digest.update(data)
        self._size += len(data)
        self._buffer += data
        while len(self._buffer) >= PART_SIZE:
            self._send_part(bytes(self._buffer[:PART_SIZE]))
            del self._buffer[:PART_SIZE]

    def _send_part(self, data: bytes) -> None:
        client, bucket = self.store.client, self.store.bucket
        with s3_errors(self.key):
            if self._upload_id is None:
                answer = client.create_multipart_upload(
                    Bucket=bucket, Key=self.key, ContentType=self.content_type
                )
                self._upload_id = answer["UploadId"]
            number = len(self._parts) + 1
            part = client.upload_part(
                Bucket=bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=data
            )
        self._parts.append({"ETag": part["ETag"], "PartNumber": number})

    def commit(self) -> StoredObject:
        """Send the last part and complete (or PUT the whole object when it fit one part)."""
        digest = self._digest.hexdigest()
        client, bucket = self.store.client, self.store.bucket
        if self._upload_id is None:
            with s3_errors(self.key):
                client.put_object(
                    Bucket=bucket,
                    Key=self.key,
                    Body=bytes(self._buffer),
                    ContentType=self.content_type,
                    Metadata={SHA256_METADATA_KEY: digest},
                )
        else:
            if self._buffer or not self._parts:
                self._send_part(bytes(self._buffer))
            with s3_errors(self.key):
                client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},  # type: ignore[typeddict-item]
                )
        self._buffer.clear()
        return StoredObject(self.key, self._size, digest, self.content_type)

    def abort(self) -> None:
        """Abort the multipart upload, if one started."""
        self._buffer.clear()
        if self._upload_id is not None:
            with contextlib.suppress(ObjectStoreError), s3_errors(self.key):
                self.store.client.abort_multipart_upload(
                    Bucket=self.store.bucket, Key=self.key, UploadId=self._upload_id
                )
            self._upload_id = None


class _LocalWriter:
    """A temporary file beside the target, renamed into place (with its sidecar) on commit."""

    def __init__(self, store: LocalObjectStore, key: str, content_type: str) -> None:
        self.key = key
        self.content_type = content_type
        self._path = store._path(key)  # same package: the store's own key checks
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=".tmp-")
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self._digest = hashlib.sha256()
        self._size = 0

    def write(self, data: bytes) -> None:
        """Append `data` to the temporary file."""
        self._digest.update(data)
        self._size += len(data)
        self._file.write(data)

    def commit(self) -> StoredObject:
        """fsync, rename into place, then write the sidecar (as `LocalObjectStore.put` does)."""
        digest = self._digest.hexdigest()
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._path)
            sidecar = {
                "content_type": self.content_type,
                "metadata": {},
                "sha256": digest,
                "size": self._size,
            }
            tmp_sidecar = self._path.with_name(self._path.name + ".meta.json.tmp")
            tmp_sidecar.write_bytes(json.dumps(sidecar).encode())
            os.replace(tmp_sidecar, self._path.with_name(self._path.name + ".meta.json"))
        except OSError as exc:
            raise ObjectStoreError(f"local object store failed for {self.key!r}: {exc}") from exc
        return StoredObject(self.key, self._size, digest, self.content_type)

    def abort(self) -> None:
        """Remove the temporary file."""
        with contextlib.suppress(OSError):
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def open_writer(store: ObjectStore, key: str, content_type: str) -> ObjectWriter:
    """A streamed writer for `key` in `store` (S3 or local)."""
    if isinstance(store, S3ObjectStore):
        return _S3Writer(store, key, content_type)
    if isinstance(store, LocalObjectStore):
        return _LocalWriter(store, key, content_type)
    raise TypeError(f"no streamed writes for {type(store).__name__}")


def read_range(store: ObjectStore, key: str, start: int, length: int) -> bytes:
    """Up to `length` bytes of `key` from byte `start` (b'' at or past the end)."""
    if length <= 0:
        return b""
    if isinstance(store, S3ObjectStore):
        check_key(store.prefix, key)
        try:
            with s3_errors(key):
                answer = store.client.get_object(
                    Bucket=store.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}"
                )
                data: bytes = answer["Body"].read()
        except ObjectStoreError as exc:
            if "InvalidRange" in str(exc):  # the start lies at or past the end
                return b""
            raise
        return data
    if isinstance(store, LocalObjectStore):
        path = store._path(key)  # same package: the store's own key checks
        try:
            with open(path, "rb") as handle:
                handle.seek(start)
                return handle.read(length)
        except FileNotFoundError as exc:
            raise ObjectNotFound(key) from exc
        except OSError as exc:
            raise ObjectStoreError(f"local object store failed for {key!r}: {exc}") from exc
    raise TypeError(f"no ranged reads for {type(store).__name__}")


def iter_chunks(store: ObjectStore, key: str, chunk_size: int = READ_CHUNK) -> Iterator[bytes]:
    """The bytes of `key` in chunks, read as they are consumed."""
    offset = 0
    while True:
        chunk = read_range(store, key, offset, chunk_size)
        if not chunk:
            return
        yield chunk
        offset += len(chunk)
        if len(chunk) < chunk_size:
            return


def iter_lines(store: ObjectStore, key: str, chunk_size: int = READ_CHUNK) -> Iterator[bytes]:
    """The lines of `key` (without their newline), read as they are consumed."""
    rest = b""
    for chunk in iter_chunks(store, key, chunk_size):
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield from lines
    if rest:
        yield rest
