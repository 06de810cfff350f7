"""Redis restart detection per queue (storage/queues.py `server_changed`).

On a private redis-server (AOF on), restarted for real: each queue sees the restart once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from tests.e2e.services import PrivateRedis


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[tuple[PrivateRedis, JobStore]]:
    server = PrivateRedis(tmp_path)
    store = JobStore.from_settings(StorageSettings(redis_url=server.url, redis_namespace="t"))
    yield server, store
    store.redis.close()
    server.stop()


def test_each_queue_sees_a_restart_once(restartable: tuple[PrivateRedis, JobStore]) -> None:
    server, store = restartable
    first = store.server_run_id()
    assert not store.server_changed("bulk.tiny", first)  # first sight: nothing to compare with
    assert not store.server_changed("bulk.tiny", first)
    server.restart(down_s=0.1)
    store.redis.connection_pool.disconnect()
    second = store.server_run_id()
    assert second != first
    assert store.server_changed("bulk.tiny", second)
    assert not store.server_changed("bulk.tiny", second)  # a second node serving it: handled
    assert not store.server_changed("interactive.tiny", second)  # never seen before
