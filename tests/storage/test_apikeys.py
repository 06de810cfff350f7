"""API keys: create, look up by hash, list, revoke."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.settings import StorageSettings


@pytest.fixture
def api_keys(storage_settings: StorageSettings) -> Iterator[ApiKeyStore]:
    """An ApiKeyStore on the test namespace."""
    store = ApiKeyStore.from_settings(storage_settings)
    yield store
    store.redis.close()


def test_create_lookup_list_revoke(api_keys: ApiKeyStore) -> None:
    admin = api_keys.create("hash-admin", "ops", admin=True)
    user = api_keys.create("hash-user", "team-a", admin=False)
    assert admin.admin
    assert not user.admin
    assert admin.id != user.id
    assert api_keys.lookup("hash-user") == user
    assert api_keys.lookup("unknown") is None
    assert [k.id for k in api_keys.list()] == [admin.id, user.id]
    assert api_keys.revoke(user.id) is True
    assert api_keys.revoke(user.id) is False
    assert api_keys.revoke("key_unknown") is False
    assert api_keys.lookup("hash-user") is None
    assert [k.revoked for k in api_keys.list()] == [False, True]


def test_duplicate_hash_refused(api_keys: ApiKeyStore) -> None:
    api_keys.create("same", "a")
    with pytest.raises(ValueError, match="exists already"):
        api_keys.create("same", "b")
