"""The API's key cache (KILN_API_KEY_CACHE_S): a revoked key is refused within the bound.

Real Redis keys; the Authenticator's clock is a counter the test moves, so the bound is checked
exactly, not against the wall clock.
"""

from __future__ import annotations

import pytest

from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.auth import Authenticator, AuthError, hash_api_key, new_api_key


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keys(job_store: JobStore, storage_settings: StorageSettings) -> ApiKeyStore:
    return ApiKeyStore(job_store.redis, storage_settings)


def bearer(secret: str) -> str:
    return f"Bearer {secret}"


def test_a_revoked_key_is_refused_once_the_cache_time_has_passed(keys: ApiKeyStore) -> None:
    clock = Clock()
    auth = Authenticator(keys, enabled=True, cache_s=2.0, clock=clock)
    secret = new_api_key()
    key = keys.create(hash_api_key(secret), "alice")
    assert auth.principal(bearer(secret)).key_id == key.id
    assert keys.revoke(key.id)
    clock.now += 1.999  # within the documented bound the cached record may still answer
    assert auth.principal(bearer(secret)).key_id == key.id
    clock.now += 0.001
    with pytest.raises(AuthError):
        auth.principal(bearer(secret))
    clock.now -= 1.0  # and it never comes back from the cache
    with pytest.raises(AuthError):
        auth.principal(bearer(secret))


def test_without_a_cache_revocation_is_immediate(keys: ApiKeyStore) -> None:
    auth = Authenticator(keys, enabled=True, cache_s=0.0, clock=Clock())
    secret = new_api_key()
    key = keys.create(hash_api_key(secret), "bob")
    auth.principal(bearer(secret))
    keys.revoke(key.id)
    with pytest.raises(AuthError):
        auth.principal(bearer(secret))


def test_an_unknown_key_is_not_cached(keys: ApiKeyStore) -> None:
    auth = Authenticator(keys, enabled=True, cache_s=60.0, clock=Clock())
    secret = new_api_key()
    with pytest.raises(AuthError):
        auth.principal(bearer(secret))
    key = keys.create(hash_api_key(secret), "carol")  # created after a refusal: accepted at once
    assert auth.principal(bearer(secret)).key_id == key.id


def test_a_cached_key_spares_the_redis_read(keys: ApiKeyStore, job_store: JobStore) -> None:
    clock = Clock()
    auth = Authenticator(keys, enabled=True, cache_s=1.0, clock=clock)
    secret = new_api_key()
    keys.create(hash_api_key(secret), "dave")
    auth.principal(bearer(secret))
    job_store.redis.delete(job_store.keys.api_key(hash_api_key(secret)))  # gone from Redis
    assert auth.principal(bearer(secret)).name == "dave"
    clock.now += 1.0
    with pytest.raises(AuthError):
        auth.principal(bearer(secret))
