"""What a process builds once: its settings, the job store, the object store, the Celery app.

`ProcessParts` is the one place they are built; `this_process()` is the process's own. A
long-running command starts it first (`start_process()`: `kiln api`, `kiln worker`, `kiln
control`), from the environment as it is then, and everything in the process takes its parts from
there (the webhook tasks a worker runs, Celery's own command line, which starts none and gets
them from the environment on first ask), so a process reads its environment once and holds one
Redis client. A CLI command on Redis builds its own `ProcessParts` (in use, one command is one
process; in tests, many run in one interpreter, each with its own environment). Each part is
built on first use: a remote CLI command reads the settings and never loads Redis, Celery or
boto3. Tests build their own `ProcessParts` from the settings they choose.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings

if TYPE_CHECKING:
    from celery import Celery

    from kiln.storage.apikeys import ApiKeyStore
    from kiln.storage.job_store import JobStore
    from kiln.storage.objects import ObjectStore
    from kiln.tasks.queue.messages import CeleryMessages
    from kiln.tasks.queue.submit import Submitter

T = TypeVar("T")


class ProcessParts:
    """Settings, stores and the Celery app of one process, each built once, on first use."""

    def __init__(
        self,
        settings: KilnSettings | None = None,
        storage_settings: StorageSettings | None = None,
        *,
        celery_app: Celery | None = None,
    ) -> None:
        # reentrant: a part is built from others (the store from the storage settings)
        self._lock = threading.RLock()
        given = {"settings": settings, "storage_settings": storage_settings, "celery": celery_app}
        self._built: dict[str, Any] = {
            name: part for name, part in given.items() if part is not None
        }

    def _once(self, name: str, build: Callable[[], T]) -> T:
        # threads ask at once (a worker's webhook tasks): the first builds, the others wait
        with self._lock:
            if name not in self._built:
                self._built[name] = build()
            return cast(T, self._built[name])

    @property
    def settings(self) -> KilnSettings:
        """Kiln's settings (`KILN_*`)."""
        return self._once("settings", KilnSettings)

    @property
    def storage_settings(self) -> StorageSettings:
        """Redis and the object store's settings."""
        return self._once("storage_settings", StorageSettings)

    @property
    def store(self) -> JobStore:
        """The job store, with the process's Redis client."""
        from kiln.storage.job_store import JobStore

        return self._once("store", lambda: JobStore.from_settings(self.storage_settings))

    @property
    def api_keys(self) -> ApiKeyStore:
        """The API keys, on the job store's Redis client."""
        from kiln.storage.apikeys import ApiKeyStore

        return self._once("api_keys", lambda: ApiKeyStore(self.store.redis, self.storage_settings))

    @property
    def objects(self) -> ObjectStore:
        """The object store (S3 or a local folder) the settings name."""
        from kiln.storage.objects import open_object_store

        return self._once("objects", lambda: open_object_store(self.storage_settings))

    @property
    def celery_app(self) -> Celery:
        """The Celery app (Kiln's broker, key prefix and serializers; tasks are bound later)."""
        from kiln.tasks.queue.app import make_celery_app

        return self._once("celery", lambda: make_celery_app(self.settings, self.storage_settings))

    @property
    def submitter(self) -> Submitter:
        """What publishes the jobs this process creates, the same for every way in.

        Where the broker is Kiln's own Redis, a new job's message goes in its creation script
        (one round trip: no job is ever written without its message); elsewhere Celery
        publishes it after the record is written, and the sweeper publishes what that missed.
        """
        from kiln.tasks.queue.submit import Submitter, celery_publisher

        def build() -> Submitter:
            publish = celery_publisher(self.celery_app)
            return Submitter(self.store, self.settings, publish, messages=self.messages)

        return self._once("submitter", build)

    @property
    def messages(self) -> CeleryMessages | None:
        """The builder of jobs' broker messages a creation script may push, or None.

        None where the broker is not Kiln's Redis, or task events are on (only Celery's own
        publish sends a message's `task-sent` event).
        """
        from kiln.tasks.queue.messages import CeleryMessages

        def build() -> CeleryMessages | None:
            usable = CeleryMessages.usable_for(self.settings, self.storage_settings)
            return CeleryMessages(self.celery_app) if usable else None

        return self._once("messages", build)


_this_process: ProcessParts | None = None
_this_process_lock = threading.Lock()


def start_process() -> ProcessParts:
    """Make fresh parts, from the environment as it is now, this process's: a command's first step.

    (A second start, as when tests run commands one after another in one interpreter, replaces
    the first: what the previous command built is not the next one's.)
    """
    global _this_process
    with _this_process_lock:
        _this_process = ProcessParts()
        return _this_process


def this_process() -> ProcessParts:
    """The parts of the running process: those it started, else built from its environment."""
    global _this_process
    with _this_process_lock:
        if _this_process is None:
            _this_process = ProcessParts()
        return _this_process
