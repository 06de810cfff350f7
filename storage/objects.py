"""Object stores for outputs: S3-compatible or a local directory, chosen by the storage URL."""

from __future__ import annotations

from collections.abc import Iterator

from kiln.storage.errors import ObjectStoreError
from kiln.storage.local_store import LocalObjectStore, parse_file_url
from kiln.storage.object_base import (
    ObjectStore,
    StoredObject,
    check_key,
    new_attempt_name,
    output_key,
    preview_key,
)
from kiln.storage.s3_store import S3ObjectStore, parse_s3_url
from kiln.storage.settings import StorageSettings

__all__ = [
    "LocalObjectStore",
    "ObjectStore",
    "S3ObjectStore",
    "StoredObject",
    "StoresByUrl",
    "check_key",
    "new_attempt_name",
    "open_object_store",
    "output_key",
    "preview_key",
    "read_stream",
    "store_named",
]


class StoresByUrl:
    """The object stores records name, each opened once.

    This process's own, or the one a record says it was written to (`storage_url`), reached
    with this process's credentials.
    """

    def __init__(self, own: ObjectStore, settings: StorageSettings) -> None:
        self.own = own
        self.settings = settings
        self._opened: dict[str, ObjectStore] = {}

    def at(self, storage_url: str | None) -> ObjectStore:
        """The store at `storage_url`; this process's own for its own URL or none recorded."""
        if not storage_url or storage_url == self.settings.storage_url:
            return self.own
        if storage_url not in self._opened:
            other = self.settings.model_copy(update={"storage_url": storage_url})
            self._opened[storage_url] = open_object_store(other)
        return self._opened[storage_url]


def open_object_store(settings: StorageSettings) -> ObjectStore:
    """The store `settings.storage_url` names: `s3://bucket/prefix` or `file:///abs/path`."""
    if settings.storage_url.startswith("s3://"):
        return S3ObjectStore.from_settings(settings)
    if settings.storage_url.startswith("file://"):
        return LocalObjectStore.from_settings(settings)
    raise ValueError(f"unsupported storage_url {settings.storage_url!r}")


def store_named(own: ObjectStore, storage_url: str | None) -> ObjectStore:
    """The store a record names (`storage_url`), reached through `own`'s connection.

    `own` for its own URL or none recorded; a `file://` folder as it is; another S3 bucket or
    prefix through `own`'s S3 client (the same endpoint and credentials). What `own` cannot
    reach (S3 from a process with a local store) is an ObjectStoreError.
    """
    if not storage_url:
        return own
    if storage_url.startswith("file://"):
        root = parse_file_url(storage_url)
        if isinstance(own, LocalObjectStore) and own.root == root.resolve():
            return own
        return LocalObjectStore(root)
    if storage_url.startswith("s3://") and isinstance(own, S3ObjectStore):
        bucket, prefix = parse_s3_url(storage_url)
        if (bucket, prefix) == (own.bucket, own.prefix):
            return own
        return S3ObjectStore(own.client, bucket, prefix, presign_client=own.presign_client)
    raise ObjectStoreError(f"outputs in {storage_url} cannot be read from this process's store")


def read_stream(store: ObjectStore, key: str, start: int, stop: int) -> Iterator[bytes]:
    """Bytes `start` up to `stop` (exclusive) of `key`, read as they are consumed."""
    if isinstance(store, (LocalObjectStore, S3ObjectStore)):
        return store.stream(key, start, stop)
    raise TypeError(f"no streamed reads for {type(store).__name__}")
