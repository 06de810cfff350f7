"""What the cluster's loops need, from the process's parts: settings, stores, the Celery app."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from celery import Celery

from kiln.storage.job_store import JobStore
from kiln.storage.objects import ObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.process import ProcessParts
from kiln.tasks.queue.submit import Submitter


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
    def of(cls, parts: ProcessParts, *, owner: str | None = None) -> ControlContext:
        """The loops' context from the process's parts (`kiln control`: `this_process()`)."""
        store, app = parts.store, parts.celery_app
        return cls(
            settings=parts.settings,
            storage_settings=parts.storage_settings,
            store=store,
            objects=parts.objects,
            celery_app=app,
            submitter=parts.submitter,
            owner=owner or default_control_id(),
        )


def default_control_id() -> str:
    """A control process's id, unique per process: `control-<host>-<pid>`."""
    return f"control-{socket.gethostname()}-{os.getpid()}"
