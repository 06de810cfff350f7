"""The write-acknowledgement rule (KILN_REDIS_MIN_REPLICAS_ACK) on a real primary and replica.

A job's creation is answered only once a replica has it (else ReplicasBehind, a 503); a node's
start and end wait for the replica too, and on a shortfall log and go on. The scripts run by sha
next to the WAIT reload on a Redis that never ran them (a primary after a failover).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.storage.async_creation import AsyncCreation
from kiln.storage.base import ReplicasBehind, async_redis_client
from kiln.storage.job_store import JobStore
from kiln.storage.records import NewJob
from kiln.storage.settings import StorageSettings
from tests.e2e.sentinel_rig import RedisNode, redis_binary


@pytest.fixture(scope="module")
def primary_and_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNode]:
    """A primary (yielded) with one replica in sync; the replica is `primary.replica`."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server installed")
    folder = tmp_path_factory.mktemp("replica-ack")
    primary = RedisNode(binary, folder / "primary")
    replica = RedisNode(binary, folder / "replica", replica_of=primary.port)
    replica.wait_in_sync()
    primary.replica = replica  # type: ignore[attr-defined]
    yield primary
    replica.stop()
    primary.stop()


def _store(primary: RedisNode, acks: int, timeout_s: float = 5.0) -> JobStore:
    settings = StorageSettings(
        redis_url=f"redis://127.0.0.1:{primary.port}/0",
        redis_namespace=f"ack-{uuid.uuid4().hex[:8]}",
        redis_min_replicas_ack=acks,
        redis_replica_ack_timeout_s=timeout_s,
        storage_url=f"file://{Path('/tmp').resolve()}/kiln-ack-test",
    )
    return JobStore.from_settings(settings)


def _new() -> NewJob:
    return NewJob(id=uuid.uuid4().hex, request={"prompt": "x"})


def test_an_acknowledged_creation_is_on_the_replica_when_it_returns(
    primary_and_replica: RedisNode,
) -> None:
    store = _store(primary_and_replica, acks=1)
    replica = primary_and_replica.replica.client()  # type: ignore[attr-defined]
    for create in (store.create_job, lambda new: store.create_and_place(new)):
        new = _new()
        create(new)
        assert replica.exists(store.keys.job(new.id))


def test_the_asyncio_creation_waits_for_the_replica_too(primary_and_replica: RedisNode) -> None:
    store = _store(primary_and_replica, acks=1)
    replica = primary_and_replica.replica.client()  # type: ignore[attr-defined]
    new = _new()

    async def create() -> None:
        creation = AsyncCreation(store, async_redis_client(store.settings, 2))
        try:
            await creation.create_and_place(new)
        finally:
            await creation.aclose()

    asyncio.run(create())
    assert replica.exists(store.keys.job(new.id))


def test_without_a_replica_a_creation_is_refused_and_a_transition_goes_on(
    primary_and_replica: RedisNode, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(primary_and_replica, acks=2, timeout_s=0.2)  # one replica: never enough
    with pytest.raises(ReplicasBehind, match=r"1 of 2 Redis replicas"):
        store.create_job(_new())
    with pytest.raises(ReplicasBehind):
        store.create_jobs([_new(), _new()])
    # what was written stays (the producer retries with its Idempotency-Key); a node's
    # transition cannot be taken back: it logs and goes on
    new = _new()
    with pytest.raises(ReplicasBehind):
        store.create_and_place(new)
    with caplog.at_level(logging.WARNING, logger="kiln.storage.base"):
        token, record = store.acquire_and_start(new.id, "node/1")
        assert store.succeed(new.id, token, [], {}).state == "succeeded"
    assert record.state == "running"
    assert "not on a replica yet" in caplog.text


def test_scripts_reload_next_to_the_wait_on_a_redis_that_never_ran_them(
    primary_and_replica: RedisNode,
) -> None:
    store = _store(primary_and_replica, acks=1)
    new = _new()
    store.create_job(new)
    store.redis.script_flush()  # as a promoted replica that never loaded them
    token, _record = store.acquire_and_start(new.id, "node/1")
    store.redis.script_flush()
    assert store.succeed(new.id, token, [], {}).state == "succeeded"
    store.redis.script_flush()
    store.create_and_place(_new())
