"""Object stores for outputs: S3-compatible or a local directory, chosen by the storage URL."""

from __future__ import annotations

from kiln.storage.local_store import LocalObjectStore
from kiln.storage.object_base import (
    ObjectStore,
    StoredObject,
    check_key,
    new_attempt_name,
    output_key,
    preview_key,
)
from kiln.storage.s3_store import S3ObjectStore
from kiln.storage.settings import StorageSettings

__all__ = [
    "LocalObjectStore",
    "ObjectStore",
    "S3ObjectStore",
    "StoredObject",
    "check_key",
    "new_attempt_name",
    "open_object_store",
    "output_key",
    "preview_key",
]


def open_object_store(settings: StorageSettings) -> ObjectStore:
    """The store `settings.storage_url` names: `s3://bucket/prefix` or `file:///abs/path`."""
    if settings.storage_url.startswith("s3://"):
        return S3ObjectStore.from_settings(settings)
    if settings.storage_url.startswith("file://"):
        return LocalObjectStore.from_settings(settings)
    raise ValueError(f"unsupported storage_url {settings.storage_url!r}")
