"""The node's checkpoint writer against real Redis and a moto S3 server whose puts can fail.

`FlakyPuts` wraps the real object store and fails chosen puts the way the S3 layer reports an
outage (ObjectStoreUnavailable, retryable): before the object is sent, or after it was stored
(the answer lost). Everything else is the real store.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from kiln.common.states import JobState
from kiln.gpu_worker.protocol import StepCheckpoint
from kiln.storage.checkpoints import Checkpoints, recorded_checkpoints
from kiln.storage.errors import ObjectStoreUnavailable
from kiln.storage.job_store import JobStore
from kiln.storage.object_base import ObjectStore, StoredObject
from kiln.storage.objects import new_attempt_name, open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.node.checkpoints import CheckpointWriter
from tests.storage.helpers import WORKER, job_in_state


class FlakyPuts:
    """An object store whose first `fail` puts raise ObjectStoreUnavailable."""

    def __init__(self, objects: ObjectStore, fail: int, *, after_storing: bool = False) -> None:
        self._objects = objects
        self.prefix = objects.prefix
        self._fail = fail
        self._after_storing = after_storing
        self.puts = 0

    def put(self, key: str, data: bytes, *args: Any, **kwargs: Any) -> StoredObject:
        self.puts += 1
        failing = self.puts <= self._fail
        if failing and not self._after_storing:
            raise ObjectStoreUnavailable(f"put {key}: 503 SlowDown (injected)")
        stored = self._objects.put(key, data, *args, **kwargs)
        if failing:
            raise ObjectStoreUnavailable(f"put {key}: connection reset (injected, stored)")
        return stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._objects, name)


@pytest.fixture
def objects(s3_settings: StorageSettings) -> ObjectStore:
    return open_object_store(s3_settings)


def checkpoint(steps_done: int) -> StepCheckpoint:
    return StepCheckpoint(1, "request-1", steps_done, 40, os.urandom(2048))


def writer_of(store: JobStore, objects: object, job_id: str, token: int) -> CheckpointWriter:
    checkpoints = Checkpoints(store, objects)  # type: ignore[arg-type]
    return CheckpointWriter(checkpoints, job_id, token, new_attempt_name(token))


@pytest.mark.parametrize("after_storing", [False, True], ids=["put-refused", "answer-lost"])
def test_a_stop_checkpoint_whose_put_fails_once_is_written_on_retry(
    job_store: JobStore, objects: ObjectStore, after_storing: bool
) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    flaky = FlakyPuts(objects, fail=1, after_storing=after_storing)
    writer = writer_of(job_store, flaky, job_id, token)
    stop = checkpoint(17)
    writer.hand(stop)  # as a drain's stop hands it, just before the attempt closes the writer
    writer.close()

    recorded = recorded_checkpoints(job_store, job_id)
    assert [ref.steps_done for ref in recorded] == [17]
    assert writer.written == recorded
    assert objects.get(recorded[0].key) == stop.data
    assert flaky.puts == 2


def test_a_fenced_write_is_not_retried(job_store: JobStore, objects: ObjectStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.requeue(job_id, token, {"type": "NodeLost", "message": "gone", "retryable": True})
    job_store.start(job_id, job_store.acquire_lease(job_id, WORKER))  # another attempt holds it
    flaky = FlakyPuts(objects, fail=0)
    writer = writer_of(job_store, flaky, job_id, token)
    writer.hand(checkpoint(5))
    writer.close()

    assert recorded_checkpoints(job_store, job_id) == []
    assert (flaky.puts, writer.written) == (1, [])


def test_retries_end_within_the_close_s_limit(job_store: JobStore, objects: ObjectStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    flaky = FlakyPuts(objects, fail=10**6)  # the store never comes back
    writer = writer_of(job_store, flaky, job_id, token)
    writer.hand(checkpoint(9))
    finished = writer.close(timeout_s=7.0)

    assert finished  # the writer gave up by itself, not left retrying past close
    assert flaky.puts >= 2
    assert recorded_checkpoints(job_store, job_id) == []
