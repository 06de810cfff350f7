"""KILN_UPLOAD_VERIFY: which uploads are read back, and that a read-back catches a bad store.

Against the moto S3 server (server mode), HEAD requests are counted on the wire with botocore's
event hooks. moto, like S3 and MinIO, echoes the ChecksumSHA256 of a put; a store that ignores
checksums does not, which the `not_echoing` fixture reproduces by dropping the echo from the
answer as such a store would send it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiln.storage.local_store import LocalObjectStore
from kiln.storage.object_base import StoredObject
from kiln.storage.objects import output_key
from kiln.storage.s3_store import S3ObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.node.output_uploads import OutputVerificationFailed, UploadVerify, put_verified

DATA = b"\x89PNG not really, but bytes"
ATTEMPT = "1-0123abcd"


@pytest.fixture
def s3_store(s3_settings: StorageSettings) -> S3ObjectStore:
    return S3ObjectStore.from_settings(s3_settings)


@pytest.fixture
def heads(s3_store: S3ObjectStore) -> list[str]:
    """Keys of the HEAD requests the store's client sends from now on."""
    sent: list[str] = []

    def count(params: dict[str, Any], **_: Any) -> None:
        sent.append(str(params["Key"]))

    s3_store.client.meta.events.register("provide-client-params.s3.HeadObject", count)
    return sent


@pytest.fixture
def not_echoing(s3_store: S3ObjectStore) -> Iterator[None]:
    """The store answers puts as one that ignores checksums: no ChecksumSHA256 in the answer."""

    def drop_echo(parsed: dict[str, Any], **_: Any) -> None:
        parsed.pop("ChecksumSHA256", None)

    s3_store.client.meta.events.register("after-call.s3.PutObject", drop_echo)
    yield
    s3_store.client.meta.events.unregister("after-call.s3.PutObject", drop_echo)


def upload(store: Any, verify: UploadVerify, index: int = 0) -> str:
    key = output_key(store.prefix, "job1", index, "png", attempt=ATTEMPT)
    return put_verified(store, key, DATA, "image/png", {"job-id": "job1"}, verify)


def test_checksum_mode_trusts_a_store_that_echoed_the_checksum(
    s3_store: S3ObjectStore, heads: list[str]
) -> None:
    sha256 = upload(s3_store, "checksum")
    assert heads == []
    stored = s3_store.head(output_key(s3_store.prefix, "job1", 0, "png", attempt=ATTEMPT))
    assert stored is not None
    assert (stored.sha256, stored.size) == (sha256, len(DATA))


def test_head_mode_reads_every_upload_back(s3_store: S3ObjectStore, heads: list[str]) -> None:
    upload(s3_store, "head")
    assert heads == [output_key(s3_store.prefix, "job1", 0, "png", attempt=ATTEMPT)]


@pytest.mark.usefixtures("not_echoing")
def test_a_store_that_does_not_confirm_the_checksum_is_read_back(
    s3_store: S3ObjectStore, heads: list[str]
) -> None:
    upload(s3_store, "checksum")
    assert heads == [output_key(s3_store.prefix, "job1", 0, "png", attempt=ATTEMPT)]


def test_multipart_uploads_are_read_back(s3_settings: StorageSettings) -> None:
    store = S3ObjectStore.from_settings(s3_settings)
    key = output_key(store.prefix, "job1", 0, "bin", attempt=ATTEMPT)
    big = bytes(6 * 1024 * 1024)
    store.multipart_threshold_bytes = 5 * 1024 * 1024  # S3's smallest part: two parts
    stored = store.put(key, big, "application/octet-stream")
    assert not stored.checksum_verified


class LosingStore(LocalObjectStore):
    """A store that ignores checksums and keeps other bytes than it was sent (a broken disk)."""

    def put(
        self,
        key: str,
        data: bytes,
        content_type: str,
        metadata: dict[str, str] | None = None,
        *,
        create_only: bool = False,
    ) -> StoredObject:
        stored = super().put(key, data[:-1], content_type, metadata, create_only=create_only)
        return StoredObject(key, len(data), stored.sha256, content_type, stored.metadata)


@pytest.mark.parametrize("verify", ["checksum", "head"])
def test_a_local_store_is_read_back_in_both_modes(tmp_path: Path, verify: UploadVerify) -> None:
    good = LocalObjectStore(tmp_path / "good", "outputs")
    stored = good.put(output_key("outputs", "job1", 0, "png", attempt=ATTEMPT), DATA, "image/png")
    assert not stored.checksum_verified
    upload(good, verify, index=1)
    with pytest.raises(OutputVerificationFailed):
        upload(LosingStore(tmp_path / "bad", "outputs"), verify)
