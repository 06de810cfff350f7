"""Create-only puts: a key that exists is never replaced, on either store (issue 23, item 1)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kiln.storage.errors import ObjectExists
from kiln.storage.objects import (
    LocalObjectStore,
    ObjectStore,
    S3ObjectStore,
    new_attempt_name,
    open_object_store,
    output_key,
)
from kiln.storage.settings import StorageSettings

MIB = 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def store(
    request: pytest.FixtureRequest, storage_settings: StorageSettings, s3_settings: StorageSettings
) -> ObjectStore:
    """Each store, opened from its settings the way Kiln opens it."""
    settings = storage_settings if request.param == "local" else s3_settings
    return open_object_store(settings)


def a_key(store: ObjectStore, job_id: str = "job-1") -> str:
    return output_key(store.prefix, job_id, 0, "png", attempt=new_attempt_name(1))


def test_a_second_create_of_a_key_is_refused_and_changes_nothing(store: ObjectStore) -> None:
    key = a_key(store)
    first = os.urandom(2048)
    stored = store.put(key, first, "image/png", {"job-id": "job-1"}, create_only=True)
    assert stored.sha256 == hashlib.sha256(first).hexdigest()
    with pytest.raises(ObjectExists):
        store.put(key, b"a late writer's bytes", "image/webp", {"job-id": "x"}, create_only=True)
    assert store.get(key) == first
    head = store.head(key)
    assert head is not None
    assert (head.size, head.sha256, head.content_type) == (len(first), stored.sha256, "image/png")
    assert head.metadata == {"job-id": "job-1"}
    assert not ObjectExists.retryable


def test_create_only_refuses_a_key_written_by_a_plain_put(store: ObjectStore) -> None:
    key = a_key(store, "job-2")
    store.put(key, b"committed", "image/png")
    with pytest.raises(ObjectExists):
        store.put(key, b"late", "image/png", create_only=True)
    assert store.get(key) == b"committed"


def test_s3_multipart_create_is_refused_at_completion(s3_settings: StorageSettings) -> None:
    store = S3ObjectStore.from_settings(s3_settings)
    store.multipart_threshold_bytes = 5 * MIB  # S3's smallest part: two parts of 8 and 1 MiB
    key = a_key(store, "job-big")
    first, late = os.urandom(9 * MIB), os.urandom(9 * MIB)
    store.put(key, first, "video/mp4", create_only=True)
    answer = store.client.head_object(Bucket=store.bucket, Key=key)
    assert answer["ETag"].strip('"').endswith("-2")  # went multipart
    with pytest.raises(ObjectExists):
        store.put(key, late, "video/mp4", create_only=True)
    assert hashlib.sha256(store.get(key)).digest() == hashlib.sha256(first).digest()
    # the refused upload was aborted: no parts are left to pay for
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket)
    assert uploads.get("Uploads", []) == []


def test_local_refused_create_leaves_no_temp_files(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path, "outputs")
    key = a_key(store)
    store.put(key, b"first", "image/png", create_only=True)
    with pytest.raises(ObjectExists):
        store.put(key, b"second", "image/png", create_only=True)
    folder = (tmp_path / key).parent
    assert sorted(p.name for p in folder.iterdir()) == ["0.png", "0.png.meta.json"]
    assert list(store.list_keys("outputs/job-1")) == [key]
