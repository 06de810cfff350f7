"""Submission: the only code that publishes `run_job`.

A job is accepted once its `queued` record is written; publishing comes second. If publishing
fails the record stays `published=False` and a node's sweeper re-publishes it later, so an accepted
job is never lost and the caller still gets its id. With `CeleryMessages` (the API, when the
broker is Kiln's Redis) the two are one step: the creation script pushes the message Celery built
along with the record, so `submit` costs one Redis round trip.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from kiln.common.request import DRAWN_SEED_LIMIT
from kiln.storage.errors import StorageError
from kiln.storage.job_store import JobRecord, JobStore, NewJob, request_fingerprint
from kiln.tasks.contract.limits import declared_limits
from kiln.tasks.contract.request_check import (
    PipelineDecl,
    PipelineUnknown,
    Violation,
    check_request,
)
from kiln.tasks.contract.schemas import JobRequest
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


class UnknownPipeline(ValueError):
    """The request names a pipeline no configuration or live node serves."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(PipelineUnknown(name, tuple(known)).message)
        self.name = name
        self.known = list(known)


def celery_publisher(app: Any) -> Publish:
    """A `Publish` that sends `kiln.run_job` through a Celery app (by name: no torch import)."""

    def publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
        app.send_task(RUN_JOB_TASK, args=[job_id], queue=queue, countdown=countdown or None)

    return publish


def job_queue(record: JobRecord) -> str:
    """The queue a job's record belongs on (as stored; derived for records that predate it)."""
    return record.queue or queue_name(record.lane, str(record.request.get("pipeline", "default")))


def new_job_id() -> str:
    """A fresh job id: random, URL-safe, no separators that could escape an object key."""
    return uuid.uuid4().hex


class Submitter:
    """Checks requests against what nodes serve, writes `queued` records and publishes them."""

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

    def violation(self, request: JobRequest) -> Violation | None:
        """Why what nodes serve would refuse `request` (`check_request`); None when it passes."""
        return check_request(request, self.declared(request.pipeline))

    def _served_now(self) -> Served:
        return self._served.now()

    def submit(
        self,
        request: JobRequest,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
        batch_id: str | None = None,
        max_queued: int | None = None,
        max_depth: int | None = None,
    ) -> tuple[JobRecord, bool]:
        """Accept one job; returns its record and whether it was created (vs an idempotent hit).

        `max_queued`: QuotaExceeded (nothing written) while `owner` has that many queued jobs;
        `max_depth`: QueueFull (nothing written) while that many jobs are queued in all.
        """
        self._refuse(request)
        new = self.new_job(request, owner=owner, idempotency_key=idempotency_key, batch_id=batch_id)
        record, created = self.store.create_job(
            new, max_queued=max_queued, max_depth=max_depth, message=self.message_for(new)
        )
        self.accepted(record, created)
        return record, created

    def new_job(
        self,
        request: JobRequest,
        *,
        owner: str | None = None,
        idempotency_key: str | None = None,
        batch_id: str | None = None,
    ) -> NewJob:
        """The job `submit` writes for `request`, which its caller has checked (`violation`)."""
        effective = request
        if request.seed is None:
            effective = request.model_copy(update={"seed": random.randrange(DRAWN_SEED_LIMIT)})
        return NewJob(
            id=new_job_id(),
            request=effective.model_dump(mode="json"),
            batch_id=batch_id,
            metadata=dict(request.metadata or {}),
            owner=owner,
            idempotency_key=idempotency_key,
            # of the request as sent (defaults filled, no drawn seed): a replay must match it
            fingerprint=request_fingerprint(request.to_record()) if idempotency_key else None,
            lane=str(request.priority),
            queue=queue_name(str(request.priority), request.pipeline),
        )

    def message_for(self, new: NewJob) -> tuple[str, str] | None:
        """The new job's broker message for its creation script to push; None: publish after."""
        if self._messages is None or not new.queue:
            return None
        try:
            return self._messages.run_job(new.id, new.queue)
        except (RedisError, OperationalError, OSError) as exc:
            # Celery's first message of a queue needs the broker: without it, the write that
            # follows says whether Redis is down (503), or the job is published after it
            log.warning("building job %s's message failed (%s); publishing after", new.id, exc)
            return None

    def message_is_ready(self, new: NewJob) -> bool:
        """Whether `message_for(new)` answers without the broker (its queue's template is built)."""
        if self._messages is None or not new.queue:
            return True
        return self._messages.is_ready(new.id, new.queue)

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
            self.publish(record)

    def submit_many(
        self,
        requests: Sequence[JobRequest],
        *,
        owner: str | None = None,
        batch_id: str | None = None,
    ) -> list[str]:
        """Accept many jobs with one pipelined write, then publish each; returns their ids."""
        for index, request in enumerate(requests):
            self._refuse(request, (index,))
        news = [self.new_job(r, owner=owner, batch_id=batch_id) for r in requests]
        self.store.create_jobs(news)
        for new in news:
            self._publish_and_mark(new.id, queue_name(new.lane, new.request["pipeline"]))
        return [new.id for new in news]

    def publish(self, record: JobRecord, countdown: float = 0.0) -> None:
        """(Re-)publish a queued job; failures are logged and left to the sweeper."""
        self._publish_and_mark(record.id, job_queue(record), countdown)

    def _publish_and_mark(self, job_id: str, queue: str, countdown: float = 0.0) -> None:
        try:
            self._publish(job_id, queue, countdown)
            self.store.mark_published(job_id)
        except (StorageError, RedisError, OperationalError, OSError) as exc:
            # (kombu raises a lost broker as its OperationalError, not as an OSError: a node
            # giving a start back while the primary fails over met it as a traceback)
            # The record is written: the sweeper re-publishes unconfirmed jobs, nothing is lost.
            log.warning("publishing job %s failed (%s); the sweeper will retry", job_id, exc)

    def _refuse(self, request: JobRequest, loc: tuple[str | int, ...] = ()) -> None:
        """Raise why what nodes serve refuses `request`, as JobRequest's callers already catch.

        UnknownPipeline for its pipeline's name; else a pydantic ValidationError at `loc`
        naming the limit, input or adapter the pipeline refuses.
        """
        violation = self.violation(request)
        if isinstance(violation, PipelineUnknown):
            raise UnknownPipeline(violation.pipeline, violation.known)
        if violation is not None:
            raise violation.error(loc)
