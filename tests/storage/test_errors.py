"""Errors are translated at the boundary: redis and botocore never leak out of storage."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import redis
from pydantic import SecretStr

from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.errors import (
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreUnavailable,
    StorageError,
    StorageUnavailable,
)
from kiln.storage.objects import S3ObjectStore
from kiln.storage.s3_errors import translate_client_error
from kiln.storage.settings import StorageSettings
from kiln.storage.status import JobStore
from tests.storage.helpers import new_job


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_job_store_on_closed_port_is_unavailable(tmp_path: Path) -> None:
    settings = StorageSettings(
        redis_url=f"redis://127.0.0.1:{closed_port()}/0", storage_url=f"file://{tmp_path}"
    )
    store = JobStore.from_settings(settings)
    with pytest.raises(StorageUnavailable) as caught:
        store.get("job-1")
    assert caught.value.retryable
    assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
    with pytest.raises(StorageUnavailable):
        store.create_job(new_job())
    with pytest.raises(StorageUnavailable):
        store.create_jobs([new_job(), new_job()])
    with pytest.raises(StorageUnavailable):
        ApiKeyStore.from_settings(settings).lookup("x")


def test_bytes_client_refused(storage_settings: StorageSettings) -> None:
    bytes_client: Any = redis.Redis.from_url(storage_settings.redis_url)
    with pytest.raises(ValueError, match="decode_responses"):
        JobStore(bytes_client, storage_settings)


def test_redis_error_becomes_storage_error(job_store: JobStore) -> None:
    job_store.redis.set(job_store.keys.job("wrongtype"), "not a hash")
    with pytest.raises(StorageError) as caught:
        job_store.get("wrongtype")
    assert not caught.value.retryable


def test_s3_on_closed_port_is_unavailable() -> None:
    settings = StorageSettings(
        storage_url="s3://bucket/p",
        s3_endpoint_url=f"http://127.0.0.1:{closed_port()}",
        s3_region="us-east-1",
        s3_access_key_id="testing",
        s3_secret_access_key=SecretStr("testing"),
        object_store_max_attempts=1,
    )
    store = S3ObjectStore.from_settings(settings)
    with pytest.raises(ObjectStoreUnavailable) as caught:
        store.put("p/job/0.png", b"x", "image/png")
    assert caught.value.retryable


def test_s3_missing_bucket_and_key(s3_settings: StorageSettings) -> None:
    store = S3ObjectStore.from_settings(s3_settings)
    with pytest.raises(ObjectNotFound):
        store.get("outputs/job/0.png")
    assert store.head("outputs/job/0.png") is None
    store.delete("outputs/job/0.png")  # deleting nothing is fine
    other = S3ObjectStore(store.client, "no-such-bucket", "outputs")
    with pytest.raises(ObjectStoreError) as caught:
        other.put("outputs/job/0.png", b"x", "image/png")
    assert not caught.value.retryable


def _client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return botocore.exceptions.ClientError(response, "PutObject")


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        ("SlowDown", 503, ObjectStoreUnavailable),
        ("InternalError", 500, ObjectStoreUnavailable),
        ("Whatever", 502, ObjectStoreUnavailable),
        ("NoSuchKey", 404, ObjectNotFound),
        ("AccessDenied", 403, ObjectStoreError),
    ],
)
def test_client_error_translation(code: str, status: int, kind: type[ObjectStoreError]) -> None:
    error = translate_client_error(_client_error(code, status), "k")
    assert type(error) is kind
