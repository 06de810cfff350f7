"""The write-acknowledgement rule (KILN_REDIS_MIN_REPLICAS_ACK) on a real primary and replica.

A job's creation is answered only once a replica has it (else ReplicasBehind, a 503); a node's
start and end are held, WAIT asked again on the same connection, until the replica has them or
the hold (`KILN_REDIS_REPLICA_ACK_HOLD_S`, at most half the lease) ends, then ReplicasBehind.
The scripts run by sha next to the WAIT reload on a Redis that never ran them (a primary after
a failover).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions

from kiln.storage.async_creation import AsyncCreation
from kiln.storage.base import (
    ReplicasBehind,
    _AsyncPrimaryConnection,
    _PrimaryConnection,
    async_redis_client,
)
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


def _store(primary: RedisNode, acks: int, timeout_s: float = 5.0, hold_s: float = 10.0) -> JobStore:
    settings = StorageSettings(
        redis_url=f"redis://127.0.0.1:{primary.port}/0",
        redis_namespace=f"ack-{uuid.uuid4().hex[:8]}",
        redis_min_replicas_ack=acks,
        redis_replica_ack_timeout_s=timeout_s,
        redis_replica_ack_hold_s=hold_s,
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


def test_without_a_replica_a_creation_is_refused_and_a_transition_is_held_then_refused(
    primary_and_replica: RedisNode,
) -> None:
    store = _store(primary_and_replica, acks=2, timeout_s=0.2, hold_s=0.6)  # one replica: never
    with pytest.raises(ReplicasBehind, match=r"1 of 2 Redis replicas"):
        store.create_job(_new())
    with pytest.raises(ReplicasBehind):
        store.create_jobs([_new(), _new()])
    # what was written stays (the producer retries with its Idempotency-Key)
    new = _new()
    with pytest.raises(ReplicasBehind):
        store.create_and_place(new)
    # a node's start is held for the hold, then refused: the node computes nothing on it
    token, _ = store.hold(new.id, "node/1", "node", 0)
    began = time.monotonic()
    with pytest.raises(ReplicasBehind, match=r"within its 0.6s hold"):
        store.start(new.id, token, node_id="node")
    assert time.monotonic() - began >= 0.6
    # the start stands on the primary that answered (its lease lapses if the node gives up)
    assert store.get(new.id).state == "running"


def test_a_transition_waits_for_a_replica_that_falls_behind_within_the_hold(
    primary_and_replica: RedisNode,
) -> None:
    """The replica frozen (SIGSTOP) for 1.5 s: the start returns once it has the write."""
    store = _store(primary_and_replica, acks=1, timeout_s=0.2, hold_s=6.0)
    replica_node: RedisNode = primary_and_replica.replica  # type: ignore[attr-defined]
    new = _new()
    store.create_and_place(new)
    token, _ = store.hold(new.id, "node/1", "node", 0)
    assert replica_node.process is not None
    replica_node.process.send_signal(signal.SIGSTOP)
    thaw = threading.Timer(1.5, replica_node.process.send_signal, (signal.SIGCONT,))
    thaw.start()
    try:
        began = time.monotonic()
        record = store.start(new.id, token, node_id="node")
        held_s = time.monotonic() - began
    finally:
        thaw.join()
        replica_node.process.send_signal(signal.SIGCONT)
    assert record.state == "running"
    assert held_s >= 1.0  # it waited for the frozen replica (one WAIT lasts 0.2 s)
    replica = replica_node.client()
    assert replica.hget(store.keys.job(new.id), "state") == "running"


def test_scripts_reload_next_to_the_wait_on_a_redis_that_never_ran_them(
    primary_and_replica: RedisNode,
) -> None:
    store = _store(primary_and_replica, acks=1)
    new = _new()
    store.create_job(new)
    store.redis.script_flush()  # as a promoted replica that never loaded them
    token, _record = store.hold(new.id, "node/1", "node", 0)
    store.redis.script_flush()
    store.start(new.id, token, node_id="node")
    store.redis.script_flush()
    assert store.succeed(new.id, token, [], {}).state == "succeeded"
    store.redis.script_flush()
    store.create_and_place(_new())


class _Named:
    """What a Sentinel-found primary's pool tells its connections: where the primary is now."""

    is_master, check_connection = True, False

    def __init__(self, port: int) -> None:
        self.port = port

    def get_master_address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


class _AsyncNamed(_Named):
    async def get_master_address(self) -> tuple[str, int]:  # type: ignore[override]
        return "127.0.0.1", self.port


def test_a_reconnect_asks_the_sentinels_and_refuses_a_replica(
    primary_and_replica: RedisNode,
) -> None:
    """redis-py's retry reconnects with the last address it had (redis-py issue 3874); ours asks.

    After a failover the old primary comes back as an empty replica: a call retried there ran a
    job's script on it (not found). A reconnect goes where the Sentinels point, checked by ROLE.
    """
    replica: RedisNode = primary_and_replica.replica  # type: ignore[attr-defined]
    named = _Named(primary_and_replica.port)
    pool: Any = named  # (what the pool tells its connections, no more)
    connection = _PrimaryConnection(connection_pool=pool, decode_responses=True)
    connection.send_command("PING")  # connects through the pool's answer
    assert connection.read_response() == "PONG"
    connection.disconnect()  # what a retry does on a lost connection
    named.port = replica.port  # the Sentinels name another server now: a replica (stale)
    with pytest.raises(redis.exceptions.ConnectionError, match="is a slave, not the primary"):
        connection.send_command("PING")  # (before: back to the old address, unchecked)
    named.port = primary_and_replica.port
    connection.send_command("PING")
    assert connection.read_response() == "PONG"
    connection.disconnect()

    async def reconnect() -> None:
        named = _AsyncNamed(primary_and_replica.port)
        pool: Any = named  # (what the pool tells its connections, no more)
        connection = _AsyncPrimaryConnection(connection_pool=pool, decode_responses=True)
        await connection.send_command("PING")
        assert await connection.read_response() == "PONG"
        await connection.disconnect()
        named.port = replica.port
        with pytest.raises(redis.exceptions.ConnectionError, match="not the primary"):
            await connection.send_command("PING")
        await connection.disconnect()

    asyncio.run(reconnect())
