"""The job messages a node worker holds: received from the broker and not yet finished.

Celery hands a worker a message before the task runs: a countdown's message waits in the worker
until it is due, and every message waits a moment before its task takes the job's lease. If the
node is killed then, the broker gives the message back only after its visibility timeout (an hour
by default), and the job would sit `queued` that long. So the node records the ids of the jobs
whose messages it holds: within `HELD_LIST_INTERVAL_S` of each arrival, by its own loop (so the
Celery consumer never waits on Redis for it), and at each heartbeat (storage/nodes.py
`record_held`),
and a live node's sweeper publishes again the still-queued jobs of a node whose heartbeat lapsed
(tasks/control/sweeper.py `sweep_unpublished`). kombu has recorded a delivery a moment before
the strategy below notes it (tasks/queue/kombu_redis.py, item 4); a node killed before its
list names a message is covered by tasks/control/unacked.py (its lapse window's slack is seconds,
the listing's delay at most `HELD_LIST_INTERVAL_S`).

When the broker connection breaks (a Redis restart, a failover), Celery drops the messages it had
received and not started (its consumer's `on_close`), and kombu's attempt to give them back goes
through the broken connection: they may sit in its `unacked` hash until the visibility timeout.
So at the consumer's restart the node lets those deliveries go: their jobs are owed a message
(tasks/queue/submit.py `Submitter.owe`), published again once Redis answers.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

from celery import bootsteps, signals
from celery.worker import state

from kiln.storage.errors import StorageError

log = logging.getLogger(__name__)

# how soon a message that reached the worker is listed (the node's `held` loop)
HELD_LIST_INTERVAL_S = 0.02


class HeldDeliveries:
    """Celery task id -> job id of every `run_job` message received and not yet finished.

    With `publish_with`, the list is written to Redis by the node's `held` loop once a message
    arrived (`write_if_changed`) and by each heartbeat (`write`). Writes happen under the lock,
    so the last one written is the newest list. A finished message is dropped from the next
    write only: a job listed after it ended is harmless (the sweeper publishes only queued
    jobs), one missing from the list is not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, str] = {}
        self._changed = False  # a message arrived since the last write
        self._publish: Callable[[list[str]], None] | None = None
        # this process's token in the node's entry: a node restarted with a fixed --node-id must
        # not overwrite what its previous life held (storage/lua/held_record.lua)
        self.incarnation = uuid.uuid4().hex[:12]

    def publish_with(self, publish: Callable[[list[str]], None]) -> None:
        """Write the list with `publish` from now on (the node's heartbeat store call)."""
        self._publish = publish

    def received(self, task_id: str, job_id: str) -> None:
        """A message for `job_id` reached this worker: listed by the next `write_if_changed`.

        (No I/O: the Celery consumer calls it for every message it hands on.)
        """
        with self._lock:
            self._jobs[task_id] = job_id
            self._changed = True

    def write_if_changed(self) -> None:
        """Write the list if a message arrived since the last write (the node's `held` loop)."""
        with self._lock:
            if self._changed:
                self._write_locked()

    def finished(self, task_id: str) -> None:
        """The message's task ended (ran, was revoked or rejected): the broker has its ack."""
        with self._lock:
            self._jobs.pop(task_id, None)

    def let_go_all_but(self, kept: set[str]) -> list[str]:
        """Forget every message but those of the Celery task ids `kept`; their job ids."""
        with self._lock:
            gone = [task_id for task_id in self._jobs if task_id not in kept]
            return [self._jobs.pop(task_id) for task_id in gone]

    def write(self) -> None:
        """Write the list now (each heartbeat)."""
        with self._lock:
            self._write_locked()

    def _write_locked(self) -> None:
        if self._publish is None:
            return
        self._changed = False  # what arrives from here on is in the next write
        try:
            self._publish(sorted(set(self._jobs.values())))
        except StorageError as exc:  # the next heartbeat writes it again
            log.warning("held deliveries not recorded (%s)", exc)


def held_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    """Celery's default task strategy, with each message noted as held before it is handled.

    The `run_job` task names this as its `Strategy`: the message is noted the moment the worker
    has it, before Celery logs and signals its receipt, and listed in Redis by the node's `held`
    loop within `HELD_LIST_INTERVAL_S` (a node killed before that is found in kombu's unacked
    deliveries: tasks/control/unacked.py). `task.kiln_held` is the node's list.
    """
    from celery.worker.strategy import default

    handle = default(task, app, consumer, **kwargs)
    held: HeldDeliveries = task.kiln_held

    def on_message(message: Any, body: Any, *args: Any, **more: Any) -> Any:
        try:
            job_args = message.decode()[0] if body is None else body[0]
            held.received(str(message.headers["id"]), str(job_args[0]))
        except (KeyError, IndexError, TypeError, ValueError):
            log.warning("held deliveries: a run_job message without a job id")
        return handle(message, body, *args, **more)

    return on_message


def track_held_deliveries(held: HeldDeliveries, app: Any, owe: Callable[[str], None]) -> None:
    """Keep `held` true to this worker process's Celery consumer.

    Finished messages are dropped (its signals); at a consumer restart, after a broken broker
    connection, the jobs of the messages Celery dropped are owed (`owe`) and forgotten.
    """

    def on_postrun(task_id: str, **_: Any) -> None:
        held.finished(task_id)

    def on_dropped(request: Any = None, **_: Any) -> None:
        if request is not None:
            held.finished(request.id)

    # weak=False: the receivers are closures that nothing else keeps alive
    signals.task_postrun.connect(on_postrun, weak=False)
    signals.task_revoked.connect(on_dropped, weak=False)
    signals.task_rejected.connect(on_dropped, weak=False)

    class LetGoAtReconnect(bootsteps.StartStopStep):
        """A consumer step, run at each (re)start of the consumer, before it consumes.

        The consumer restarts after a broken broker connection; at its first start nothing is
        held yet. After the step that sets up the task consumer, like kombu's own.
        """

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, parent: Any) -> None:
            del parent  # the consumer: what it kept is in celery.worker.state
            # what Celery kept at its `on_close`: the requests running (and reserved with them)
            kept = {r.id for r in (*state.active_requests, *state.reserved_requests)}
            dropped = held.let_go_all_but(kept)
            for job_id in dropped:
                owe(job_id)
            if dropped:
                log.warning(
                    "broker connection restored: %d message(s) dropped with the old one; "
                    "their jobs are published again",
                    len(dropped),
                )

    app.steps["consumer"].add(LetGoAtReconnect)
