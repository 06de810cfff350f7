"""Object store in a local directory: atomic writes (temp file + rename or link), JSON sidecars."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from kiln.storage.errors import InvalidObjectKey, ObjectExists, ObjectNotFound, ObjectStoreError
from kiln.storage.object_base import STREAM_CHUNK, StoredObject, check_key, check_metadata
from kiln.storage.settings import StorageSettings

# next to `<key>` lies `<key>.meta.json`; keys with this ending are refused so none collide
_SIDECAR_SUFFIX = ".meta.json"


def parse_file_url(url: str) -> Path:
    """`file:///abs/path` → Path('/abs/path')."""
    if not url.startswith("file://"):
        raise ValueError(f"not a file:// URL: {url!r}")
    path = Path(url[len("file://") :])
    if not path.is_absolute():
        raise ValueError(f"file:// URL must hold an absolute path: {url!r}")
    return path


@contextmanager
def _os_errors(key: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise ObjectNotFound(key) from exc
    except OSError as exc:
        raise ObjectStoreError(f"local object store failed for {key!r}: {exc}") from exc


def _file_chunks(
    handle: BinaryIO, key: str, start: int, stop: int, chunk_size: int
) -> Iterator[bytes]:
    """The chunks of an open file from `start` to `stop`; closes it however the reading ends."""
    with handle, _os_errors(key):
        handle.seek(start)
        left = stop - start
        while left > 0:
            chunk = handle.read(min(chunk_size, left))
            if not chunk:  # shorter than its record said: what there is, no padding
                return
            left -= len(chunk)
            yield chunk


# link(2) refused by the file system itself (no hard links there), not by an existing name
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK})


def write_atomically(path: Path, data: bytes, *, create_only: bool = False) -> None:
    """Replace `path` with `data`: readers see the old file or the new one, never a partial one.

    `create_only`: FileExistsError when `path` exists, which is left untouched. The complete temp
    file is hard-linked to `path` (link(2) never replaces a name); on a file system without hard
    links, `path` is created with O_EXCL and written in place.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if not create_only:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except OSError as exc:
            if exc.errno not in _NO_HARD_LINKS:
                raise
            _write_exclusively(path, data)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    Path(tmp).unlink(missing_ok=True)


def _write_exclusively(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


class LocalObjectStore:
    """Objects as files under a root directory."""

    def __init__(self, root: Path, prefix: str = "") -> None:
        self.root = root.resolve()
        self.prefix = prefix

    @classmethod
    def from_settings(cls, settings: StorageSettings) -> LocalObjectStore:
        """The store named by `settings.storage_url` (`file:///abs/path`)."""
        return cls(parse_file_url(settings.storage_url))

    def _path(self, key: str) -> Path:
        check_key(self.prefix, key)
        if key.endswith(_SIDECAR_SUFFIX):
            raise InvalidObjectKey(f"object key {key!r} has a reserved ending")
        path = self.root / key
        # a symlink inside the root must not lead outside it either
        if not path.resolve().is_relative_to(self.root):
            raise InvalidObjectKey(f"object key {key!r} escapes {self.root}")
        return path

    @staticmethod
    def _sidecar(path: Path) -> Path:
        return path.with_name(path.name + _SIDECAR_SUFFIX)

    def put(
        self,
        key: str,
        data: bytes,
        content_type: str,
        metadata: dict[str, str] | None = None,
        *,
        create_only: bool = False,
    ) -> StoredObject:
        """Write `data` atomically, then its sidecar (the sidecar's arrival completes the put).

        `create_only`: ObjectExists when `key` exists already, and nothing is written.
        """
        path = self._path(key)
        user_metadata = dict(check_metadata(metadata or {}))
        stored = StoredObject(
            key, len(data), hashlib.sha256(data).hexdigest(), content_type, user_metadata
        )
        sidecar = {
            "content_type": content_type,
            "metadata": user_metadata,
            "sha256": stored.sha256,
            "size": stored.size,
        }
        with _os_errors(key):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                write_atomically(path, data, create_only=create_only)
            except FileExistsError as exc:
                raise ObjectExists(f"object {key!r} exists already") from exc
            # the object's name is this put's alone now (or a replace was asked): its sidecar too
            write_atomically(self._sidecar(path), json.dumps(sidecar).encode())
        return stored

    def head(self, key: str) -> StoredObject | None:
        """What is stored under `key`, or None (also while a put has not completed)."""
        path = self._path(key)
        try:
            with _os_errors(key):
                sidecar = json.loads(self._sidecar(path).read_bytes())
                size = path.stat().st_size
        except ObjectNotFound:
            return None
        return StoredObject(
            key, size, sidecar["sha256"], sidecar["content_type"], dict(sidecar["metadata"])
        )

    def get(self, key: str) -> bytes:
        """The bytes under `key`; ObjectNotFound if none."""
        path = self._path(key)
        with _os_errors(key):
            return path.read_bytes()

    def stream(
        self, key: str, start: int, stop: int, chunk_size: int = STREAM_CHUNK
    ) -> Iterator[bytes]:
        """Bytes `start` up to `stop` (exclusive) of `key`, read a chunk at a time as consumed.

        Opened at the call (ObjectNotFound then, not at the first chunk); the file is closed
        when the iterator ends or is closed.
        """
        path = self._path(key)
        if stop <= start:
            return iter(())
        with _os_errors(key):
            handle = open(path, "rb")  # noqa: SIM115 - closed by the generator below
        return _file_chunks(handle, key, start, stop, chunk_size)

    def delete(self, key: str) -> None:
        """Remove `key` and its sidecar (no error if absent)."""
        path = self._path(key)
        with _os_errors(key):
            self._sidecar(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)

    def list_keys(self, folder: str) -> Iterator[str]:
        """Every complete object under `folder/` (its sidecar written), in key order."""
        base = self._path(folder)
        if not base.is_dir():
            return
        with _os_errors(folder):
            sidecars = sorted(base.rglob("*" + _SIDECAR_SUFFIX))
        for sidecar in sidecars:
            path = sidecar.with_name(sidecar.name.removesuffix(_SIDECAR_SUFFIX))
            if path.is_file():  # a sidecar whose object was deleted since does not count
                yield path.relative_to(self.root).as_posix()

    def url(self, key: str, expires_s: int | None = None) -> str:
        """`file://` URL of the object (`expires_s` does not apply)."""
        del expires_s  # the ObjectStore signature; a file URL does not expire
        return self._path(key).as_uri()
