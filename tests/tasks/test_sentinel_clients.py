"""Every Redis client Kiln makes finds the primary through Sentinels (KILN_REDIS_SENTINELS)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.storage.base import async_redis_client, redis_client
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import broker_url, make_celery_app
from kiln.tasks.queue.messages import CeleryMessages
from tests.e2e.sentinel_rig import MASTER_NAME, SentinelGroup, redis_binary


def test_sentinels_are_a_comma_list_of_host_and_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_REDIS_SENTINELS", "10.0.0.1:26379, s2:26380,[::1]:26381")
    assert StorageSettings().sentinel_addresses == [
        ("10.0.0.1", 26379),
        ("s2", 26380),
        ("::1", 26381),
    ]
    monkeypatch.setenv("KILN_REDIS_SENTINELS", "s1:26379,s2")
    with pytest.raises(ValidationError, match="'s2' is not host:port"):
        StorageSettings()


def test_the_broker_url_lists_the_sentinels_with_the_database_and_credentials() -> None:
    storage = StorageSettings(
        redis_url="redis://kiln:secret@ignored:6379/3",
        redis_sentinels=["s1:26379", "s2:26379"],
        redis_sentinel_master="jobs",
    )
    url = broker_url(KilnSettings(), storage)
    assert url == "sentinel://kiln:secret@s1:26379/3;sentinel://kiln:secret@s2:26379/3"
    assert broker_url(KilnSettings(broker_url="redis://other/0"), storage) == "redis://other/0"
    assert broker_url(KilnSettings(), StorageSettings()) == StorageSettings().redis_url
    app = make_celery_app(KilnSettings(), storage)
    assert app.conf.broker_transport_options["master_name"] == "jobs"


@pytest.fixture(scope="module")
def sentinel_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StorageSettings]:
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server installed")
    group = SentinelGroup(Path(tmp_path_factory.mktemp("sentinels")), binary)
    yield StorageSettings(
        redis_url="redis://127.0.0.1:1/0",  # nothing listens there: only the Sentinels lead
        redis_sentinels=group.addresses.split(","),
        redis_sentinel_master=MASTER_NAME,
        redis_namespace=f"sentinel-{uuid.uuid4().hex[:8]}",
    )
    group.stop()


def test_the_store_clients_reach_the_primary_through_the_sentinels(
    sentinel_settings: StorageSettings,
) -> None:
    client = redis_client(sentinel_settings)
    client.set(f"{sentinel_settings.redis_namespace}:probe", "1")

    async def read() -> str | None:
        async_client = async_redis_client(sentinel_settings, 2)
        try:
            return await async_client.get(f"{sentinel_settings.redis_namespace}:probe")
        finally:
            await async_client.aclose()  # type: ignore[attr-defined]

    assert asyncio.run(read()) == "1"


def test_job_messages_are_captured_on_a_sentinel_broker(
    sentinel_settings: StorageSettings,
) -> None:
    app = make_celery_app(KilnSettings(), sentinel_settings)
    messages = CeleryMessages(app)
    try:
        key, _message = messages.run_job("job1", "interactive.tiny")
    finally:
        messages.close()
    assert key == f"{sentinel_settings.redis_namespace}:celery:interactive.tiny"
