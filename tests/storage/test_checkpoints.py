"""Step checkpoints in the object store: fenced writes and records, and the fall-back on read.

Real Redis and both real stores (a local folder, S3 on a moto server).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from kiln.common.states import JobState
from kiln.storage.checkpoints import (
    KEPT,
    CheckpointRef,
    Checkpoints,
    checkpoint_key,
    recorded_checkpoints,
)
from kiln.storage.errors import IllegalTransition, ObjectExists, ObjectNotFound, StaleLease
from kiln.storage.job_store import JobStore
from kiln.storage.objects import new_attempt_name, open_object_store
from kiln.storage.settings import StorageSettings
from tests.storage.helpers import WORKER, job_in_state


@pytest.fixture(params=["local", "s3"])
def checkpoints(
    request: pytest.FixtureRequest,
    job_store: JobStore,
    storage_settings: StorageSettings,
    s3_settings: StorageSettings,
) -> Checkpoints:
    settings = storage_settings if request.param == "local" else s3_settings
    return Checkpoints(job_store, open_object_store(settings))


def running(store: JobStore) -> tuple[str, int, str]:
    """A running job, its lease token and a fresh attempt folder of that token."""
    job_id, token = job_in_state(store, JobState.RUNNING)
    return job_id, token, new_attempt_name(token)


def next_attempt(store: JobStore, job_id: str, token: int) -> tuple[int, str]:
    """The job handed back and started again: the new lease token and its attempt folder."""
    error = {"type": "NodeLost", "message": "gone", "retryable": True}
    store.requeue(job_id, token, error)
    new_token = store.acquire_lease(job_id, WORKER)
    store.start(job_id, new_token)
    return new_token, new_attempt_name(new_token)


def accept_all(_ref: CheckpointRef, data: bytes) -> bytes:
    return data


def test_a_checkpoint_is_written_in_its_attempts_folder_and_recorded_with_its_token(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, token, attempt = running(job_store)
    data = os.urandom(4096)
    ref = checkpoints.write(job_id, token, attempt, 12, data)
    assert ref.key == checkpoint_key(checkpoints.objects.prefix, job_id, attempt, 12)
    assert f"/{job_id}/{attempt}/checkpoints/" in f"/{ref.key}"
    assert (ref.lease_token, ref.steps_done, ref.size) == (token, 12, len(data))
    assert checkpoints.objects.get(ref.key) == data
    assert recorded_checkpoints(job_store, job_id) == [ref]
    found, resumed = checkpoints.latest(job_id, accept_all)
    assert (found, resumed.ref, resumed.refusals) == (data, ref, [])


def test_a_record_says_whether_it_names_checkpoints(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, token, attempt = running(job_store)
    assert not job_store.get(job_id).checkpoints_recorded  # a node reads none for it
    checkpoints.write(job_id, token, attempt, 3, os.urandom(64))
    assert job_store.get(job_id).checkpoints_recorded
    next_attempt(job_store, job_id, token)  # the record its next attempt starts from, too
    assert job_store.get(job_id).checkpoints_recorded


def test_the_record_keeps_the_newest_few_and_deletes_the_rest(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, token, attempt = running(job_store)
    refs = [checkpoints.write(job_id, token, attempt, step, b"s%d" % step) for step in range(1, 6)]
    kept = recorded_checkpoints(job_store, job_id)
    assert [ref.steps_done for ref in kept] == [5, 4, 3][:KEPT]
    for ref in refs[: len(refs) - KEPT]:
        with pytest.raises(ObjectNotFound):
            checkpoints.objects.get(ref.key)


def test_a_write_tried_again_takes_its_own_object_and_is_recorded_once(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, token, attempt = running(job_store)
    older = checkpoints.write(job_id, token, attempt, 4, b"step 4")
    first = checkpoints.write(job_id, token, attempt, 7, b"step 7")
    # its answer was lost: the node's writer tries the same write again
    again = checkpoints.write(job_id, token, attempt, 7, b"step 7")
    assert again == first
    assert recorded_checkpoints(job_store, job_id) == [first, older]
    assert checkpoints.objects.get(older.key) == b"step 4"  # nothing fell off for a duplicate
    with pytest.raises(ObjectExists):  # the key holds other bytes: not this write's
        checkpoints.write(job_id, token, attempt, 7, b"other bytes")
    assert recorded_checkpoints(job_store, job_id) == [first, older]


def test_a_stale_token_records_nothing_and_leaves_no_object(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    store = job_store
    job_id, old_token, old_attempt = running(store)
    first = checkpoints.write(job_id, old_token, old_attempt, 4, b"first attempt, step 4")
    new_token, new_attempt = next_attempt(store, job_id, old_token)
    second = checkpoints.write(job_id, new_token, new_attempt, 6, b"second attempt, step 6")
    # the first attempt's node wakes up (it was frozen) and writes on: refused, and its bytes go
    with pytest.raises(StaleLease):
        checkpoints.write(job_id, old_token, old_attempt, 8, b"a stale writer's step 8")
    assert recorded_checkpoints(store, job_id) == [second, first]
    with pytest.raises(ObjectNotFound):
        checkpoints.objects.get(checkpoint_key(checkpoints.objects.prefix, job_id, old_attempt, 8))
    assert checkpoints.latest(job_id, accept_all)[0] == b"second attempt, step 6"


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.SUCCEEDED])
def test_only_a_running_job_records_checkpoints(job_store: JobStore, state: JobState) -> None:
    checkpoints = Checkpoints(job_store, open_object_store(job_store.settings))
    job_id, token = job_in_state(job_store, state)
    with pytest.raises((StaleLease, IllegalTransition)):
        checkpoints.write(job_id, token, new_attempt_name(token), 3, b"late")
    assert recorded_checkpoints(job_store, job_id) == []


def test_an_attempt_folder_of_another_token_is_refused_before_writing(
    job_store: JobStore,
) -> None:
    checkpoints = Checkpoints(job_store, open_object_store(job_store.settings))
    job_id, token, _ = running(job_store)
    with pytest.raises(ValueError, match="not a folder of lease token"):
        checkpoints.write(job_id, token, new_attempt_name(token + 1), 3, b"x")


# --- hostile checkpoints: passed over with a reason, never failing the job -----------------------


def three_checkpoints(
    job_store: JobStore, checkpoints: Checkpoints
) -> tuple[str, list[CheckpointRef]]:
    """A running job with checkpoints after steps 2, 4 and 6; refs newest first."""
    job_id, token, attempt = running(job_store)
    for step in (2, 4, 6):
        checkpoints.write(job_id, token, attempt, step, b"state after step %d" % step)
    return job_id, recorded_checkpoints(job_store, job_id)


def test_a_missing_object_falls_back_to_the_next_older(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, refs = three_checkpoints(job_store, checkpoints)
    checkpoints.objects.delete(refs[0].key)
    found, resumed = checkpoints.latest(job_id, accept_all)
    assert found == b"state after step 4"
    assert resumed.ref == refs[1]
    assert len(resumed.refusals) == 1
    assert "missing" in resumed.refusals[0]


@pytest.mark.parametrize(
    "damage",
    [lambda data: data[:-3], lambda data: data[:-1] + b"X", lambda data: data + b"more"],
    ids=["truncated", "altered", "extended"],
)
def test_bytes_other_than_recorded_fall_back(
    job_store: JobStore, checkpoints: Checkpoints, damage: Callable[[bytes], bytes]
) -> None:
    job_id, refs = three_checkpoints(job_store, checkpoints)
    bad = damage(checkpoints.objects.get(refs[0].key))
    checkpoints.objects.put(refs[0].key, bad, "application/octet-stream")
    found, resumed = checkpoints.latest(job_id, accept_all)
    assert found == b"state after step 4"
    assert "corrupt" in resumed.refusals[0]


def test_a_record_naming_another_tokens_folder_is_refused(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, refs = three_checkpoints(job_store, checkpoints)
    store = job_store
    entries = json.loads(store.redis.hget(store.keys.job(job_id), "checkpoints") or "[]")
    entries[0]["lease_token"] += 1  # says a later lease wrote it: its folder says otherwise
    store.redis.hset(store.keys.job(job_id), "checkpoints", json.dumps(entries))
    found, resumed = checkpoints.latest(job_id, accept_all)
    assert found == b"state after step 4"
    assert "lease token" in resumed.refusals[0]
    assert resumed.ref == refs[1]


def test_what_the_node_refuses_falls_back_and_none_left_means_step_0(
    job_store: JobStore, checkpoints: Checkpoints
) -> None:
    job_id, refs = three_checkpoints(job_store, checkpoints)

    def refuse_all(ref: CheckpointRef, _data: bytes) -> bytes:
        raise ValueError(f"another pipeline identity (step {ref.steps_done})")

    found, resumed = checkpoints.latest(job_id, refuse_all)
    assert found is None
    assert resumed.ref is None
    assert [r.split(": ", 1)[0] for r in resumed.refusals] == [ref.key for ref in refs]
    assert all("another pipeline identity" in reason for reason in resumed.refusals)


def test_a_job_without_checkpoints_starts_from_step_0(job_store: JobStore) -> None:
    checkpoints = Checkpoints(job_store, open_object_store(job_store.settings))
    job_id, _, _ = running(job_store)
    found, resumed = checkpoints.latest(job_id, accept_all)
    assert (found, resumed.ref, resumed.refusals) == (None, None, [])
