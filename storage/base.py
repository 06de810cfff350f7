"""What every part of the job store shares: the client, key names, the loaded scripts."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import redis
from redis.backoff import EqualJitterBackoff
from redis.retry import Retry

from storage import lua, lua_create, lua_global, lua_leases
from storage.errors import JobNotFound
from storage.keys import Keys, valid_id
from storage.records import JobRecord, job_from_hash, pairs_to_dict
from storage.settings import StorageSettings

# scripts that use the job calling convention (storage/lua.py's PRELUDE comes first)
_JOB_SCRIPTS = {
    "transition": lua.TRANSITION,
    "cancel": lua.CANCEL,
    "reap": lua.REAP,
    "progress": lua.PROGRESS,
    "create": lua_create.CREATE,
    "create_many": lua_create.CREATE_MANY,
    "acquire": lua_leases.ACQUIRE,
    "renew": lua_leases.RENEW,
    "release": lua_leases.RELEASE,
    "mark_published": lua_leases.MARK_PUBLISHED,
    "webhook_attempt": lua_leases.WEBHOOK_ATTEMPT,
}
_GLOBAL_SCRIPTS = {
    "lease_deadlines_passed": lua_global.LEASE_DEADLINES_PASSED,
    "unpublished": lua_global.UNPUBLISHED,
    "publish_node": lua_global.PUBLISH_NODE,
    "live_nodes": lua_global.LIVE_NODES,
    "create_batch": lua_global.CREATE_BATCH,
    "prune_indexes": lua_global.PRUNE_INDEXES,
}


def redis_client(settings: StorageSettings) -> redis.Redis[str]:
    """A client for `settings.redis_url` as the stores expect it (str replies, short retries)."""
    return redis.Redis.from_url(
        settings.redis_url,
        decode_responses=True,
        socket_timeout=settings.redis_socket_timeout_s,
        socket_connect_timeout=settings.redis_connect_timeout_s,
        # bounded, so a flood of clients fails fast instead of opening Redis connections unbounded
        max_connections=settings.redis_max_connections,
        # a few quick retries ride out a blip; longer outages surface as StorageUnavailable
        # (retryable) instead of stalling the caller for seconds
        retry=Retry(EqualJitterBackoff(cap=0.5, base=0.05), 3),
        health_check_interval=30,
    )


def check_client(client: redis.Redis[str]) -> None:
    """Refuse a client that returns bytes: every reply is parsed as str."""
    if not client.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError("the Redis client must be created with decode_responses=True")


class StoreBase:
    """Client, settings, key names and loaded scripts shared by the job store's parts."""

    def __init__(self, redis_client: redis.Redis[str], settings: StorageSettings) -> None:
        check_client(redis_client)
        self.redis = redis_client
        self.settings = settings
        self.keys = Keys(settings.redis_namespace)
        self._sources = {name: lua.PRELUDE + body for name, body in _JOB_SCRIPTS.items()}
        self._sources.update(_GLOBAL_SCRIPTS)
        self._scripts = {
            name: redis_client.register_script(source) for name, source in self._sources.items()
        }
        k = self.keys
        self._context = [
            k.job_prefix,
            k.state_index_prefix,
            k.batch_prefix,
            k.batch_index_prefix,
            k.idempotency_prefix,
            k.owner_index_prefix,
            settings.event_stream_maxlen,
            settings.retention_s,
        ]
        self._global_keys = [
            k.running,
            k.unpublished,
            k.queue_depth,
            k.all_index,
            k.creation_seq,
            k.retired,
        ]

    def _call(self, name: str, job_id: str, *args: Any) -> Any:
        """Run a job script on `job_id`."""
        return self._scripts[name](
            keys=self.keys.job_scoped(job_id) + self._global_keys,
            args=[*self._context, job_id, *args],
        )

    def _queue_job_script(self, pipe: Any, name: str, job_id: str, *args: Any) -> None:
        """Queue a job script on a pipeline by its sha (the caller makes sure it is loaded)."""
        keys = self.keys.job_scoped(job_id) + self._global_keys
        # Redis names a cached script by the sha1 of its source
        sha = hashlib.sha1(self._sources[name].encode(), usedforsecurity=False).hexdigest()
        pipe.evalsha(sha, len(keys), *keys, *self._context, job_id, *args)

    def _load_script(self, name: str) -> None:
        """Load a script into Redis's cache (needed before it is used by sha in a pipeline)."""
        self.redis.execute_command("SCRIPT", "LOAD", self._sources[name])

    def _call_global(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a namespace-wide script."""
        return self._scripts[name](keys=keys, args=args)

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
