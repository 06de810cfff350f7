"""API keys: records found by the hash of the secret (hashing happens in tasks)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.storage.base import check_client, redis_client
from kiln.storage.boundary import redis_boundary
from kiln.storage.keys import Keys
from kiln.storage.scripts import Scripts
from kiln.storage.settings import StorageSettings

if TYPE_CHECKING:
    import redis


@dataclass(frozen=True)
class ApiKey:
    """One API key (never the secret itself)."""

    id: str
    name: str
    admin: bool
    created_at: float
    revoked: bool
    max_queued: int | None = None  # the key's own cap on queued jobs; None: the server's
    max_running: int | None = None  # the key's own cap on running jobs; None: the server's


def _optional_int(value: str | None) -> int | None:
    return int(value) if value else None


def _api_key(data: dict[str, str]) -> ApiKey:
    return ApiKey(
        id=data["id"],
        name=data["name"],
        admin=data["admin"] == "1",
        created_at=float(data["created_at"]),
        revoked=data["revoked"] == "1",
        max_queued=_optional_int(data.get("max_queued")),
        max_running=_optional_int(data.get("max_running")),
    )


def _cap(value: int | None) -> str:
    if value is not None and value < 1:
        raise ValueError(f"a job cap must be at least 1, not {value}")
    return "" if value is None else str(value)


class ApiKeyStore:
    """Create, look up, list and revoke API keys."""

    def __init__(self, redis_client: redis.Redis[str], settings: StorageSettings) -> None:
        check_client(redis_client)
        self.redis = redis_client
        self.keys = Keys(settings.redis_namespace)
        self.scripts = Scripts(redis_client)

    @classmethod
    def from_settings(cls, settings: StorageSettings) -> ApiKeyStore:
        """A store with its own client for `settings.redis_url`."""
        return cls(redis_client(settings), settings)

    @redis_boundary
    def create(
        self,
        key_hash: str,
        name: str,
        admin: bool = False,
        *,
        max_queued: int | None = None,
        max_running: int | None = None,
    ) -> ApiKey:
        """Store a new key under `key_hash`; ValueError if that hash is already stored.

        `max_queued` and `max_running` cap the key's jobs, overriding the server's defaults.
        """
        key_id = "key_" + secrets.token_hex(8)
        keys = [self.keys.api_key(key_hash), self.keys.api_key_id(key_id), self.keys.api_key_ids]
        args = [key_id, key_hash, name, "1" if admin else "0", _cap(max_queued), _cap(max_running)]
        if not self.scripts["apikey_create"](keys, args):
            raise ValueError("an API key with this hash exists already")
        return _api_key(self.redis.hgetall(self.keys.api_key(key_hash)))

    @redis_boundary
    def lookup(self, key_hash: str) -> ApiKey | None:
        """The live key stored under `key_hash`; None if unknown or revoked."""
        data = self.redis.hgetall(self.keys.api_key(key_hash))
        if not data or data["revoked"] == "1":
            return None
        return _api_key(data)

    @redis_boundary
    def get(self, key_id: str) -> ApiKey | None:
        """The key with this id (revoked or not); None if unknown."""
        key_hash = self.redis.get(self.keys.api_key_id(key_id))
        if not key_hash:
            return None
        data = self.redis.hgetall(self.keys.api_key(key_hash))
        return _api_key(data) if data else None

    @redis_boundary
    def list(self) -> list[ApiKey]:
        """Every key, revoked ones included, oldest first."""
        key_ids = sorted(self.redis.smembers(self.keys.api_key_ids))
        pipe = self.redis.pipeline(transaction=False)
        for key_id in key_ids:
            pipe.get(self.keys.api_key_id(key_id))
        hashes = [h for h in pipe.execute() if h]
        for key_hash in hashes:
            pipe.hgetall(self.keys.api_key(key_hash))
        records = [_api_key(data) for data in pipe.execute() if data]
        return sorted(records, key=lambda k: (k.created_at, k.id))

    @redis_boundary
    def revoke(self, key_id: str) -> bool:
        """Revoke the key; True if it was live, False if unknown or already revoked."""
        keys, args = [self.keys.api_key_id(key_id)], [self.keys.api_key_prefix]
        return bool(self.scripts["apikey_revoke"](keys, args))
