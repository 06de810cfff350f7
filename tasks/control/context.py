"""What the cluster's loops need, built once per process: settings, stores, the Celery app."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from celery import Celery

from kiln.storage.job_store import JobStore
from kiln.storage.objects import ObjectStore, open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import make_celery_app
from kiln.tasks.queue.submit import Submitter, celery_publisher


@dataclass(frozen=True)
class ControlContext:
    """A process's settings, stores and Celery app; `owner` names it in the leases it takes."""

    settings: KilnSettings
    storage_settings: StorageSettings
    store: JobStore
    objects: ObjectStore
    celery_app: Celery
    submitter: Submitter
    owner: str

    @classmethod
    def build(
        cls,
        settings: KilnSettings,
        storage_settings: StorageSettings,
        *,
        owner: str | None = None,
        celery_app: Celery | None = None,
    ) -> ControlContext:
        """Every part built here, once: the one place a `kiln control` process makes them."""
        store = JobStore.from_settings(storage_settings)
        app = celery_app or make_celery_app(settings, storage_settings)
        return cls(
            settings=settings,
            storage_settings=storage_settings,
            store=store,
            objects=open_object_store(storage_settings),
            celery_app=app,
            submitter=Submitter(store, settings, celery_publisher(app)),
            owner=owner or default_control_id(),
        )


def default_control_id() -> str:
    """A control process's id, unique per process: `control-<host>-<pid>`."""
    return f"control-{socket.gethostname()}-{os.getpid()}"
