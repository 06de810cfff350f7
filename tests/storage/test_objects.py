"""Both object stores: round trips, sha256, metadata, multipart, presigned URLs, escapes."""

from __future__ import annotations

import hashlib
import os
import urllib.request
from pathlib import Path

import pytest

from kiln.storage.errors import InvalidObjectKey, ObjectNotFound
from kiln.storage.keys import valid_id
from kiln.storage.objects import (
    LocalObjectStore,
    ObjectStore,
    S3ObjectStore,
    open_object_store,
    output_key,
)
from kiln.storage.settings import StorageSettings

MIB = 1024 * 1024
ATTEMPT = "1-0123abcd"


@pytest.fixture(params=["local", "s3"])
def store(
    request: pytest.FixtureRequest, storage_settings: StorageSettings, s3_settings: StorageSettings
) -> ObjectStore:
    """Each store, opened from its settings the way Kiln opens it."""
    settings = storage_settings if request.param == "local" else s3_settings
    return open_object_store(settings)


def test_round_trip(store: ObjectStore) -> None:
    key = output_key(store.prefix, "job-1", 0, "png", attempt=ATTEMPT)
    data = os.urandom(4096)
    stored = store.put(key, data, "image/png", {"job-id": "job-1", "seed": "42"})
    digest = hashlib.sha256(data).hexdigest()
    assert (stored.key, stored.size, stored.sha256) == (key, len(data), digest)
    assert store.get(key) == data
    head = store.head(key)
    assert head is not None
    assert (head.size, head.sha256, head.content_type) == (len(data), digest, "image/png")
    assert head.metadata == {"job-id": "job-1", "seed": "42"}
    store.put(key, b"second", "image/png")  # a plain put replaces; outputs are create_only
    assert store.get(key) == b"second"
    store.delete(key)
    assert store.head(key) is None
    with pytest.raises(ObjectNotFound):
        store.get(key)


def test_url_downloads_with_urllib(store: ObjectStore) -> None:
    key = output_key(store.prefix, "job-2", 1, "webp", attempt=ATTEMPT)
    data = os.urandom(10_000)
    store.put(key, data, "image/webp")
    with urllib.request.urlopen(store.url(key, expires_s=60), timeout=30) as answer:
        body = answer.read()
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(data).hexdigest()


def test_refuses_keys_outside_prefix(store: ObjectStore) -> None:
    for key in ["../escape.png", "/etc/passwd", f"{store.prefix}/../../x.png".lstrip("/")]:
        with pytest.raises(InvalidObjectKey):
            store.put(key, b"x", "image/png")
        with pytest.raises(InvalidObjectKey):
            store.get(key)


def test_metadata_must_be_ascii_tokens(store: ObjectStore) -> None:
    key = output_key(store.prefix, "job-3", 0, "png", attempt=ATTEMPT)
    for metadata in [{"Bad Key": "x"}, {"ok": "caf\u00e9"}, {"sha256": "reserved"}]:
        with pytest.raises(ValueError, match="metadata"):
            store.put(key, b"x", "image/png", metadata)


def test_trailing_newline_is_not_an_id() -> None:
    assert not valid_id("job\n")


def test_s3_multipart_above_threshold(s3_settings: StorageSettings) -> None:
    store = S3ObjectStore.from_settings(s3_settings)
    key = output_key(store.prefix, "job-big", 0, "mp4", attempt=ATTEMPT)
    data = os.urandom(17 * MIB)
    stored = store.put(key, data, "video/mp4", {"frames": "16"})
    answer = store.client.head_object(Bucket=store.bucket, Key=key)
    assert answer["ETag"].strip('"').endswith("-3")  # 8 MiB parts: went multipart
    head = store.head(key)
    assert head is not None
    assert head.sha256 == stored.sha256 == hashlib.sha256(data).hexdigest()
    assert head.content_type == "video/mp4"
    assert head.metadata == {"frames": "16"}
    assert hashlib.sha256(store.get(key)).hexdigest() == stored.sha256


def test_s3_single_part_carries_a_sha256_checksum(s3_settings: StorageSettings) -> None:
    store = S3ObjectStore.from_settings(s3_settings)
    key = output_key(store.prefix, "job-small", 0, "png", attempt=ATTEMPT)
    store.put(key, b"pixels", "image/png")
    answer = store.client.head_object(Bucket=store.bucket, Key=key, ChecksumMode="ENABLED")
    assert "-" not in answer["ETag"]
    assert answer.get("ChecksumSHA256")
    assert "X-Amz-Expires=120" in store.url(key, expires_s=120)
    assert f"X-Amz-Expires={s3_settings.presign_expiry_s}" in store.url(key)


def test_local_store_writes_atomically_beside_a_sidecar(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    key = output_key("", "job-4", 0, "png", attempt=ATTEMPT)
    store.put(key, b"abc", "image/png", {"a": "b"})
    assert sorted(p.name for p in (tmp_path / "job-4" / ATTEMPT).iterdir()) == [
        "0.png",
        "0.png.meta.json",
    ]
    assert store.url(key) == (tmp_path / "job-4" / ATTEMPT / "0.png").as_uri()
    with pytest.raises(InvalidObjectKey):
        store.put("job-4/0.png.meta.json", b"x", "application/json")


def test_local_store_refuses_symlink_escape(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "job-5").symlink_to(outside, target_is_directory=True)
    store = LocalObjectStore(root)
    with pytest.raises(InvalidObjectKey):
        store.put(output_key("", "job-5", 0, "png", attempt=ATTEMPT), b"x", "image/png")
    assert list(outside.iterdir()) == []


def test_open_object_store_by_url(
    storage_settings: StorageSettings, s3_settings: StorageSettings
) -> None:
    local = open_object_store(storage_settings)
    assert isinstance(local, LocalObjectStore)
    assert local.prefix == ""
    s3 = open_object_store(s3_settings)
    assert isinstance(s3, S3ObjectStore)
    assert s3.prefix == "outputs"
    with pytest.raises(ValueError, match="is relative"):  # each process would differ
        StorageSettings(storage_url="file://./somewhere")


def test_list_keys_gives_every_object_under_a_folder_page_by_page(store: ObjectStore) -> None:
    folder = f"{store.prefix}/loras/tiny" if store.prefix else "loras/tiny"
    # nested keys count; a sibling folder whose name starts the same does not
    names = [f"{folder}/a{i:02d}/w.bin" for i in range(12)] + [f"{folder}/b/deep/w.bin"]
    for key in names:
        store.put(key, b"x", "application/octet-stream")
    store.put(f"{folder}-other/w.bin", b"x", "application/octet-stream")
    assert list(store.list_keys(folder)) == sorted(names)
    store.delete(names[0])
    assert list(store.list_keys(folder)) == sorted(names[1:])
    assert list(store.list_keys(f"{folder}/none")) == []
    with pytest.raises(InvalidObjectKey):
        list(store.list_keys("../escape"))


def test_s3_list_keys_follows_continuation_tokens(s3_settings: StorageSettings) -> None:
    store = S3ObjectStore.from_settings(s3_settings)
    keys = [f"outputs/many/{i:04d}" for i in range(1005)]  # moto answers 1000 keys a page
    for key in keys:
        store.client.put_object(Bucket=store.bucket, Key=key, Body=b"")
    assert list(store.list_keys("outputs/many")) == keys
