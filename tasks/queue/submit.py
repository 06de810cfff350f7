"""Publishing: the only code that publishes `run_job` (`tasks.intake` checks and writes jobs).

A job is accepted once its `queued` record is written; publishing comes second. If publishing
fails the record stays `published=False` and a node's sweeper re-publishes it later, so an accepted
job is never lost and the caller still gets its id. A re-publish (a busy lease's, a start given
back, a swept or reaped job) concerns a record marked published long ago: if it fails, while the
broker's Redis is away, the job is owed its message, in this process, and published again by its
`publish_owed` loop once Redis answers (tasks/node/maintenance.py, tasks/control/sweeper.py).

With `CeleryMessages` (the API, when the broker is Kiln's Redis) the two are one step: the
creation script pushes the message Celery built along with the record, so a submission costs one
Redis round trip.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from kiln.common.states import JobState
from kiln.storage.errors import StorageError
from kiln.storage.job_store import JobRecord, JobStore, NewJob
from kiln.tasks.contract.job_spec import JobSpec, JobSpecRefused
from kiln.tasks.contract.limits import declared_limits
from kiln.tasks.contract.request_check import PipelineDecl
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import RUN_JOB_TASK, make_celery_app
from kiln.tasks.queue.lanes import queue_name
from kiln.tasks.queue.messages import CeleryMessages
from kiln.tasks.queue.served import Served, ServedCache

log = logging.getLogger(__name__)


class Publish(Protocol):
    """Publishes `run_job(job_id)` on a queue, optionally delayed."""

    def __call__(self, job_id: str, queue: str, countdown: float = 0.0) -> None:
        """Publish `run_job(job_id)` on `queue`, `countdown` seconds from now."""


class CeleryPublisher:
    """A `Publish` that sends `kiln.run_job` through a Celery app (by name: no torch import)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, job_id: str, queue: str, countdown: float = 0.0) -> None:
        """Publish `run_job(job_id)` on `queue`, `countdown` seconds from now."""
        self.traced(job_id, queue, countdown, {})

    def traced(self, job_id: str, queue: str, countdown: float, trace: Mapping[str, str]) -> None:
        """The same, the job's W3C trace context sent as the message's headers."""
        self.app.send_task(
            RUN_JOB_TASK,
            args=[job_id],
            queue=queue,
            countdown=countdown or None,
            headers=dict(trace) or None,
        )


def celery_publisher(app: Any) -> Publish:
    """A `Publish` that sends `kiln.run_job` through a Celery app (a `CeleryPublisher`)."""
    return CeleryPublisher(app)


def job_queue(record: JobRecord, spec: JobSpec | None = None) -> str:
    """The queue a job's record belongs on (as stored; derived for records that predate it).

    `spec`: the record's, where the caller decoded it already (not decoded a second time).
    """
    if record.queue:
        return record.queue
    # a record older than its `queue` field: the queue of its spec's pipeline
    try:
        pipeline = (spec or JobSpec.decode(record.request)).pipeline
    except JobSpecRefused:
        # not a spec this release reads: published all the same (never a crash of the reaper or
        # the publisher), to the default pipeline's queue, where a node fails it by name
        pipeline = JobSpec.model_fields["pipeline"].default
    return queue_name(record.lane, pipeline)


def new_job_id() -> str:
    """A fresh job id: random, URL-safe, no separators that could escape an object key."""
    return uuid.uuid4().hex


class Submitter:
    """What nodes serve (cached), and the publishing of jobs the intake (`tasks.intake`) wrote."""

    def __init__(
        self,
        store: JobStore,
        settings: KilnSettings,
        publish: Publish | None = None,
        messages: CeleryMessages | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        if publish is None:
            publish = celery_publisher(make_celery_app(settings, store.settings))
        self._publish = publish
        # when given, `submit` hands each new job's message to the creation script instead
        self._messages = messages
        self._served = ServedCache(store, settings.pipelines)
        self._owed_lock = threading.Lock()
        # jobs owed a message (`owe`): job id -> (the owing's mark, when due, monotonic s)
        self._owed: dict[str, tuple[int, float]] = {}
        self._owed_marks = itertools.count()
        self._owed_pass = threading.Lock()  # one `publish_owed` pass at a time

    @property
    def messages(self) -> CeleryMessages | None:
        """Its builder of jobs' broker messages, where they may go with a script's write."""
        return self._messages

    def served_is_fresh(self) -> bool:
        """Whether what nodes serve is known without a Redis read (the cache is current)."""
        return self._served.is_fresh()

    def known_pipelines(self) -> list[str]:
        """Configured pipelines plus those announced by live nodes (cached for a moment)."""
        return self._served_now().names

    def live_pipelines(self) -> frozenset[str]:
        """Pipelines some live node serves now (from the same cached read of the heartbeats)."""
        return self._served_now().live

    def declared(self, pipeline: str) -> PipelineDecl:
        """What the served pipelines declare about `pipeline`, from one read of the heartbeats."""
        served = self._served_now()
        return PipelineDecl(
            known=tuple(served.names),
            limits=tuple(declared_limits(pipeline, served.limits.get(pipeline, []))),
            inputs=tuple(served.inputs.get(pipeline, [])),
            adapters=tuple(served.adapters.get(pipeline, [])),
        )

    def _served_now(self) -> Served:
        return self._served.now()

    def message_for(self, new: NewJob) -> tuple[str, str] | None:
        """The new job's broker message for its creation script to push; None: publish after."""
        if self._messages is None or not new.queue:
            return None
        try:
            return self._messages.run_job(new.id, new.queue, trace=new.trace)
        except (RedisError, OperationalError, OSError) as exc:
            # Celery's first message of a queue needs the broker: without it, the write that
            # follows says whether Redis is down (503), or the job is published after it
            log.warning("building job %s's message failed (%s); publishing after", new.id, exc)
            return None

    def message_is_ready(self, new: NewJob) -> bool:
        """Whether `message_for(new)` answers without the broker (its queue's template is built)."""
        if self._messages is None or not new.queue:
            return True
        return self._messages.is_ready(new.id, new.queue, new.trace)

    def accepted(self, record: JobRecord, created: bool) -> None:
        """After the record is written: log a new job, publish one not published yet."""
        if created:
            log.info(
                "job %s accepted on %s",
                record.id,
                job_queue(record),
                extra={"job_id": record.id},
            )
        if not record.published:  # created without its message, or a replay of such a job
            # a failure leaves it unconfirmed: the sweeper publishes it (nothing owed here)
            self._publish_and_mark(record.id, job_queue(record), 0.0, record.trace)

    def publish(self, record: JobRecord, countdown: float = 0.0) -> bool:
        """Publish a queued job again; whether the broker took it.

        A failure is logged. A record confirmed published (a busy lease's countdown, a start
        given back, a lapse-claimed job) is then owed its message (`owe`), as no sweeper would
        publish it again; an unconfirmed one stays the sweeper's.
        """
        if self._publish_and_mark(record.id, job_queue(record), countdown, record.trace):
            return True
        if record.published:
            self.owe(record.id, countdown)
        return False

    def owe(self, job_id: str, countdown: float = 0.0) -> None:
        """`job_id` is owed a message, due in `countdown` s: one this process took or sent is gone.

        A re-publish failed, or a node let a delivery go before it settled its job (Redis away
        before its lease was taken, or Celery dropping what it had prefetched as the broker
        connection broke: tasks/node/held.py). `publish_owed` publishes it again while it is
        queued and not leased. A second message of a queued job never runs it twice: one lease
        holder starts it, the others' deliveries are deferred or dropped (tasks/node/jobs.py).
        """
        with self._owed_lock:
            self._owed[job_id] = (next(self._owed_marks), time.monotonic() + countdown)

    def owed(self) -> list[str]:
        """The jobs owed a message now (a node lists them as held: its death hands them on)."""
        with self._owed_lock:
            return sorted(self._owed)

    def publish_owed(self) -> int:
        """Publish again each owed job still queued and not leased; returns how many.

        One finished or gone is no longer owed; one leased waits (its holder starts it, or its
        lease lapses and it is published here), its countdown's remainder kept. While Redis is
        away nothing changes. A pass already running elsewhere (the node's `owed` loop, its
        sweeper) makes this one return 0; a job owed again during a pass stays owed.
        """
        if not self._owed_pass.acquire(blocking=False):
            return 0
        try:
            return self._publish_owed()
        finally:
            self._owed_pass.release()

    def _publish_owed(self) -> int:
        with self._owed_lock:
            owed = dict(self._owed)
        if not owed:
            return 0
        try:
            records = self.store.get_many(sorted(owed))
            queued = [r for r in records if r is not None and r.state == JobState.QUEUED]
            leased = self.store.leased([r.id for r in queued])
        except (StorageError, RedisError) as exc:
            log.debug("owed messages wait for Redis (%s)", exc)
            return 0
        now = time.monotonic()
        published = [
            r.id
            for r in queued
            if r.id not in leased
            and self._publish_and_mark(r.id, job_queue(r), max(0.0, owed[r.id][1] - now), r.trace)
        ]
        settled = set(owed) - {r.id for r in queued}  # finished, gone or no longer queued
        with self._owed_lock:
            for job_id in settled.union(published):
                if self._owed.get(job_id) == owed[job_id]:  # not owed again meanwhile
                    del self._owed[job_id]
        if published:
            log.info("%d job(s) owed a message: published again", len(published))
        return len(published)

    def _publish_and_mark(
        self,
        job_id: str,
        queue: str,
        countdown: float = 0.0,
        trace: Mapping[str, str] | None = None,
    ) -> bool:
        try:
            if trace and isinstance(self._publish, CeleryPublisher):
                self._publish.traced(job_id, queue, countdown, trace)
            else:
                self._publish(job_id, queue, countdown)
            self.store.mark_published(job_id)
        except (StorageError, RedisError, OperationalError, OSError) as exc:
            # (kombu raises a lost broker as its OperationalError, not as an OSError: a node
            # giving a start back while the primary fails over met it as a traceback)
            log.warning("publishing job %s failed (%s)", job_id, exc)
            return False
        return True
