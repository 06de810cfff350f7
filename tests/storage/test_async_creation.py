"""`AsyncCreation` (the API's submit path): the same answers and errors as the blocking store."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis
from redis.exceptions import NoScriptError, ResponseError

from kiln.storage.async_creation import AsyncCreation
from kiln.storage.base import async_redis_client
from kiln.storage.creation import Placement, QueueFull
from kiln.storage.errors import IdempotencyConflict, QuotaExceeded, StorageUnavailable
from kiln.storage.job_store import JobStore
from kiln.storage.queues import QueueSnapshot
from kiln.storage.records import JobRecord
from kiln.storage.scripts import first_lost_script, queue_by_sha
from kiln.storage.settings import StorageSettings
from tests.conftest import on_private_redis
from tests.storage.helpers import new_job

T = TypeVar("T")
Placed = tuple[JobRecord, bool, QueueSnapshot | None]
PLACE = Placement("interactive.tiny", "bulk.tiny", ["interactive.tiny", "bulk.tiny"])


def run_async(
    settings: StorageSettings, store: JobStore, step: Callable[[AsyncCreation], Awaitable[T]]
) -> T:
    """Run `step` on a fresh event loop with its own AsyncCreation, closed after."""

    async def main() -> T:
        creation = AsyncCreation(store, async_redis_client(settings, 4))
        try:
            return await step(creation)
        finally:
            await creation.aclose()

    return asyncio.run(main())


def test_created_and_placed_as_the_blocking_store_does(
    job_store: JobStore, storage_settings: StorageSettings
) -> None:
    first = new_job(lane="interactive", queue="interactive.tiny")
    job_store.create_and_place(first, place=PLACE)
    second = new_job(lane="interactive", queue="interactive.tiny")

    async def create_twice(creation: AsyncCreation) -> tuple[Placed, Placed]:
        made = await creation.create_and_place(second, place=PLACE)
        return made, await creation.create_and_place(second, place=PLACE)

    made, (again, created_again, no_snapshot) = run_async(storage_settings, job_store, create_twice)
    record, created, snapshot = made
    assert created
    assert record == job_store.get(second.id)
    assert snapshot is not None
    assert snapshot.rank == 1  # behind the first, as queue_snapshot reads it
    sync_view = job_store.queue_snapshot(second.id, PLACE.queue, PLACE.other, PLACE.rate_queues)
    assert snapshot.rank == sync_view.rank
    assert (again, created_again, no_snapshot) == (record, False, None)
    assert job_store.queue_depth() == 2


@pytest.mark.every_redis  # an error path: the embedded 6.2 too
def test_refusals_are_the_storage_errors(
    job_store: JobStore, storage_settings: StorageSettings
) -> None:
    job_store.create_job(new_job(owner="alice", idempotency_key="k1"))

    async def over_depth(creation: AsyncCreation) -> object:
        return await creation.create_and_place(new_job(), max_depth=1)

    async def over_quota(creation: AsyncCreation) -> object:
        return await creation.create_and_place(new_job(owner="alice"), max_queued=1)

    async def conflict(creation: AsyncCreation) -> object:
        other = new_job(idempotency_key="k1", request={"prompt": "a dog"})
        return await creation.create_and_place(other)

    with pytest.raises(QueueFull):
        run_async(storage_settings, job_store, over_depth)
    with pytest.raises(QuotaExceeded):
        run_async(storage_settings, job_store, over_quota)
    with pytest.raises(IdempotencyConflict):
        run_async(storage_settings, job_store, conflict)
    assert job_store.queue_depth() == 1


@on_private_redis
def test_scripts_redis_lost_are_loaded_and_the_job_created_once(
    job_store: JobStore, storage_settings: StorageSettings
) -> None:
    new = new_job(lane="interactive", queue="interactive.tiny")

    async def flush_then_create(creation: AsyncCreation) -> object:
        await creation.redis.script_flush()
        made = await creation.create_and_place(new, place=PLACE)
        await creation.redis.script_flush()
        again = await creation.create_and_place(new, place=PLACE)
        return made[1], again[1]

    assert run_async(storage_settings, job_store, flush_then_create) == (True, False)
    assert job_store.queue_depth() == 1


def test_an_unreachable_redis_is_unavailable(storage_settings: StorageSettings) -> None:

    with socket.socket() as dead:  # bound, never listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{dead.getsockname()[1]}/0"
        down = storage_settings.model_copy(update={"redis_url": url})
        store = JobStore(redis.Redis.from_url(url, decode_responses=True), down)

        async def create(creation: AsyncCreation) -> object:
            return await creation.create_and_place(new_job())

        with pytest.raises(StorageUnavailable):
            run_async(down, store, create)


def test_a_failure_before_a_lost_script_is_raised_not_rerun() -> None:
    lost, failed = NoScriptError("NOSCRIPT"), ResponseError("KILN_CONFLICT k1")
    assert first_lost_script([1, 2]) is None
    assert first_lost_script([1, lost, failed]) == 1  # the failure after it is run again
    with pytest.raises(ResponseError):
        first_lost_script([failed, lost])


def test_a_call_by_sha_is_checked_against_the_scripts_header(job_store: JobStore) -> None:
    pipe = job_store.redis.pipeline(transaction=False)
    with pytest.raises(ValueError, match=r"create\.lua takes 14 KEYS, not 1"):
        queue_by_sha(pipe, [("create", ["only-one-key"], [])])
    assert len(pipe) == 0  # nothing queued, nothing sent
