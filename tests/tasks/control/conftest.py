"""The cluster's loops on real Redis, a real local object store and a recording publish."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery

from kiln.storage.job_store import JobStore
from kiln.storage.objects import open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.control.context import ControlContext
from kiln.tasks.queue.app import make_celery_app
from kiln.tasks.queue.kombu_redis import listed_run_job_id, queue_list_keys
from kiln.tasks.queue.submit import Submitter, celery_publisher

PIPELINE = "tiny"
QUEUE = f"interactive.{PIPELINE}"


@dataclass
class ControlHarness:
    """A control context whose publishes are recorded, not sent."""

    ctx: ControlContext
    published: list[tuple[str, str, float]] = field(default_factory=list)


ControlFactory = Callable[..., ControlHarness]


def lose_message(store: JobStore, app: Celery, job_id: str) -> str:
    """Take `job_id`'s message off its list as BRPOP does, record it nowhere; returns it."""
    key = queue_list_keys(app, QUEUE)[0]
    for raw in store.redis.lrange(key, 0, -1):
        if listed_run_job_id(raw) == job_id:
            store.redis.lrem(key, 1, raw)
            return str(raw)
    raise AssertionError(f"no message of {job_id} in {key}")


@pytest.fixture
def app(storage_settings: StorageSettings) -> Iterator[Celery]:
    """A Celery app for the tiny pipeline's queues, as a producer uses it."""
    app = make_celery_app(KilnSettings(pipelines=[PIPELINE]), storage_settings)
    yield app
    app.close()


@pytest.fixture
def submitter(job_store: JobStore, app: Celery) -> Submitter:
    """Submits through `app`: a job record and its real Celery message."""
    return Submitter(job_store, KilnSettings(pipelines=[PIPELINE]), celery_publisher(app))


@pytest.fixture
def make_control(storage_settings: StorageSettings, app: Celery) -> Iterator[ControlFactory]:
    """Control contexts on the test namespace: `make_control(**settings overrides)`."""
    stores: list[JobStore] = []

    def make(**overrides: Any) -> ControlHarness:
        settings = KilnSettings(**{"pipelines": [PIPELINE], **overrides})
        store = JobStore.from_settings(storage_settings)
        stores.append(store)
        published: list[tuple[str, str, float]] = []

        def publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
            published.append((job_id, queue, countdown))

        ctx = ControlContext(
            settings=settings,
            storage_settings=storage_settings,
            store=store,
            objects=open_object_store(storage_settings),
            celery_app=app,
            submitter=Submitter(store, settings, publish),
            owner="control-under-test",
        )
        return ControlHarness(ctx, published)

    yield make
    for store in stores:
        store.redis.close()
