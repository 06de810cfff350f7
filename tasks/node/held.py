"""The job messages a node worker holds: received from the broker and not yet finished.

Celery hands a worker a message before the task runs: a countdown's message waits in the worker
until it is due, and every message waits a moment before its task takes the job's lease. If the
node is killed then, the broker gives the message back only after its visibility timeout (an hour
by default), and the job would sit `queued` that long. So the node records the ids of the jobs
whose messages it holds as each arrives and at each heartbeat (storage/nodes.py `record_held`),
and a live node's sweeper
publishes again the still-queued jobs of a node whose heartbeat lapsed
(tasks/node/maintenance.py `sweep_unpublished`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import signals

from kiln.storage.errors import StorageError
from kiln.tasks.queue.app import RUN_JOB_TASK

log = logging.getLogger(__name__)


class HeldDeliveries:
    """Celery task id -> job id of every `run_job` message received and not yet finished.

    With `publish_with`, the list is written to Redis as each message arrives (and by each
    heartbeat): a node killed a moment after receiving a message must already have it listed.
    Writes happen under the lock, so the last one written is the newest list. A finished message
    is dropped from the next write only: a job listed after it ended is harmless (the sweeper
    publishes only queued jobs), one missing from the list is not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, str] = {}
        self._publish: Callable[[list[str]], None] | None = None

    def publish_with(self, publish: Callable[[list[str]], None]) -> None:
        """Write the list with `publish` from now on (the node's heartbeat store call)."""
        self._publish = publish

    def received(self, task_id: str, job_id: str) -> None:
        """A message for `job_id` reached this worker."""
        with self._lock:
            self._jobs[task_id] = job_id
            self._write_locked()

    def finished(self, task_id: str) -> None:
        """The message's task ended (ran, was revoked or rejected): the broker has its ack."""
        with self._lock:
            self._jobs.pop(task_id, None)

    def write(self) -> None:
        """Write the list now (each heartbeat)."""
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        if self._publish is None:
            return
        try:
            self._publish(sorted(set(self._jobs.values())))
        except StorageError as exc:  # the next heartbeat writes it again
            log.warning("held deliveries not recorded (%s)", exc)


def track_held_deliveries(held: HeldDeliveries) -> None:
    """Keep `held` up to date from this worker process's Celery signals."""

    def on_received(request: Any, **_: Any) -> None:
        if request.name == RUN_JOB_TASK and request.args:
            held.received(request.id, str(request.args[0]))

    def on_postrun(task_id: str, **_: Any) -> None:
        held.finished(task_id)

    def on_dropped(request: Any = None, **_: Any) -> None:
        if request is not None:
            held.finished(request.id)

    # weak=False: the receivers are closures that nothing else keeps alive
    signals.task_received.connect(on_received, weak=False)
    signals.task_postrun.connect(on_postrun, weak=False)
    signals.task_revoked.connect(on_dropped, weak=False)
    signals.task_rejected.connect(on_dropped, weak=False)
