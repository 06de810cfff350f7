"""ProcessParts: a process's settings, stores and Celery app, each built once, on first use."""

from __future__ import annotations

import threading

import pytest

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue import process
from kiln.tasks.queue.process import ProcessParts, start_process, this_process


def test_each_part_is_built_once_and_shares_the_one_client(
    storage_settings: StorageSettings,
) -> None:
    settings = KilnSettings(pipelines=["sleepy"])
    parts = ProcessParts(settings, storage_settings)
    assert (parts.settings, parts.storage_settings) == (settings, storage_settings)
    store = parts.store
    try:
        assert parts.store is store
        assert store.settings is storage_settings
        assert parts.api_keys.redis is store.redis  # the keys ride the store's client
        assert parts.objects is parts.objects
        app = parts.celery_app
        assert parts.celery_app is app
        assert app.conf.broker_url == storage_settings.redis_url
    finally:
        parts.celery_app.close()
        store.redis.close()


def test_threads_asking_at_once_get_one_store(storage_settings: StorageSettings) -> None:
    parts = ProcessParts(KilnSettings(), storage_settings)
    start = threading.Barrier(8)
    seen: list[JobStore] = []

    def ask() -> None:
        start.wait()
        seen.append(parts.store)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(seen) == 8
        assert all(store is seen[0] for store in seen)
    finally:
        seen[0].redis.close()


@pytest.fixture
def no_process_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """This interpreter's parts as before any start (and put back after the test)."""
    monkeypatch.setattr(process, "_this_process", None)


@pytest.mark.usefixtures("no_process_started")
def test_the_webhook_tasks_take_the_process_parts() -> None:
    # (a node runs them in its own process: the same settings and Redis client as the node's)
    from kiln.tasks.webhooks.batch_hooks import _worker_settings
    from kiln.tasks.webhooks.enqueue import _worker_deps

    parts = this_process()
    assert this_process() is parts
    deps = _worker_deps()
    assert (deps.settings, deps.store, deps.objects) == (parts.settings, parts.store, parts.objects)
    assert deps.store is parts.store
    assert _worker_settings() is parts.settings


@pytest.mark.usefixtures("no_process_started")
def test_a_started_process_reads_the_environment_as_it_is_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # commands run one after another in one interpreter (tests): each its own environment
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", "first")
    first = start_process()
    assert this_process() is first
    assert first.storage_settings.redis_namespace == "first"
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", "second")
    assert this_process().storage_settings.redis_namespace == "first"  # read once
    second = start_process()
    assert this_process() is second
    assert second.storage_settings.redis_namespace == "second"
