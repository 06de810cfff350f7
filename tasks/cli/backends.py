"""Where the CLI's job commands go: straight to Redis, or to a remote Kiln API."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kiln.common.states import JobState, is_terminal
from kiln.common.tracing import TRACEPARENT, TRACESTATE, start_tracing
from kiln.tasks.cli.exits import UsageError
from kiln.tasks.cli.short_ids import resolve_id
from kiln.tasks.contract.responses import CancelEffect, CancelResult, PauseResult, ResumeResult
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView, job_view

if TYPE_CHECKING:
    from celery import Celery

    from kiln.storage.object_base import ObjectStore
    from kiln.tasks.client.batch_downloads import DownloadReport
    from kiln.tasks.intake.intake import Intake
    from kiln.tasks.intake.pausing import JobPausing
    from kiln.tasks.queue.submit import Submitter

# a page of jobs, newest first, and the cursor of the next one (None: no more)
JobPage = tuple[list[JobView], str | None]
WHOLE = 1 << 62  # read to the end: an output recorded without its size


class JobsBackend(Protocol):
    """The job operations the CLI needs: on Redis directly, or through the API."""

    def submit(
        self,
        request: JobRequest,
        idempotency_key: str | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> JobView:
        """Submit a job (once per `idempotency_key`), its trace continuing `trace`; its view."""
        ...

    def get(self, job_id: str) -> JobView:
        """The job's view."""
        ...

    def cancel(self, job_id: str) -> CancelResult:
        """Request the job's cancellation; what it did and the job's view after it."""
        ...

    def pause(self, job_id: str) -> PauseResult:
        """Pause the job (`kiln pause`); a finished one is refused (an error, exit 1)."""
        ...

    def resume(self, job_id: str) -> ResumeResult:
        """Resume the paused job (`kiln resume`); a finished one is refused (an error, exit 1)."""
        ...

    def resolve(self, job_id: str) -> str:
        """The full id of `job_id`, which may be a unique prefix (`cli.short_ids`)."""
        ...

    def page(
        self, status: str | None, batch_id: str | None, cursor: str | None, limit: int
    ) -> JobPage:
        """One page of jobs, newest first, filtered by state and batch (`kiln jobs`)."""
        ...

    def download(self, view: JobView, folder: Path) -> DownloadReport:
        """Fetch the job's outputs into `folder`, each verified by its sha256 (`kiln get`)."""
        ...

    def pipelines(self) -> list[str]:
        """The pipelines jobs may name now (configured or served by a live node)."""
        ...

    def close(self) -> None:
        """Close the backend's connections (the command is done with it)."""
        ...


class DirectBackend:
    """Talks to Redis and the object store directly (same settings as the workers)."""

    def __init__(self) -> None:
        # Deferred: Redis, boto3 and Celery load only when the CLI talks to Redis directly, and
        # each part only when the command uses it: `kiln jobs` needs no Celery, no intake.
        from kiln.tasks.queue.process import ProcessParts

        self._parts = ProcessParts()  # the command's process: its environment, read once
        start_tracing("kiln-cli")  # its admission spans, where the OTEL_* variables ask
        self.store = self._parts.store

    @property
    def objects(self) -> ObjectStore:
        """The object store the settings name (for outputs' URLs and `kiln get`)."""
        return self._parts.objects

    @property
    def celery_app(self) -> Celery:
        """Its job events' webhooks (a pause, a resume)."""
        return self._parts.celery_app

    @property
    def submitter(self) -> Submitter:
        """As the API's: each message in its job's creation."""
        return self._parts.submitter

    @functools.cached_property
    def intake(self) -> Intake:
        """The checks of POST /v1/jobs."""
        from kiln.tasks.intake.intake import Intake

        return Intake(self.submitter, self.objects)

    def submit(
        self,
        request: JobRequest,
        idempotency_key: str | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> JobView:
        """Accept a job; an idempotent repeat returns the existing one."""
        record, _ = self.intake.submit(request, idempotency_key=idempotency_key, trace=trace)
        return job_view(record, self.objects, self.submitter.live_pipelines())

    def get(self, job_id: str) -> JobView:
        """The job's current view; a queued job's position and expected start."""
        from kiln.tasks.queue.positions import queue_estimate

        record = self.store.get(job_id)
        estimate = queue_estimate(self.store, record, self.submitter.settings.bulk_share_every)
        return job_view(record, self.objects, self.submitter.live_pipelines(), estimate)

    def cancel(self, job_id: str) -> CancelResult:
        """Cancel (queued: at once; running: at its next step; finished: nothing to do)."""
        before = self.store.get(job_id)
        if is_terminal(before.state):
            return CancelResult(effect="already_finished", job=job_view(before, self.objects))
        after = self.store.cancel(job_id)
        effect: dict[str, CancelEffect] = {
            JobState.CANCELED: "canceled",
            JobState.RUNNING: "cancel_requested",
        }
        view = job_view(after, self.objects)
        return CancelResult(effect=effect.get(after.state, "already_finished"), job=view)

    def pause(self, job_id: str) -> PauseResult:
        """Pause as the API does (tasks/intake/pausing.py); PauseRefused for a finished job."""
        effect, after = self._pausing().pause(self.store.get(job_id))
        return PauseResult(effect=effect, job=job_view(after, self.objects))

    def resume(self, job_id: str) -> ResumeResult:
        """Resume as the API does: queued again and published."""
        effect, after = self._pausing().resume(self.store.get(job_id))
        return ResumeResult(effect=effect, job=job_view(after, self.objects))

    def _pausing(self) -> JobPausing:
        from kiln.tasks.intake.pausing import JobPausing
        from kiln.tasks.webhooks.event_sink import EventSink

        return JobPausing(self.store, self.submitter, EventSink(self.store, self.celery_app))

    def resolve(self, job_id: str) -> str:
        """The job a full id or unique prefix names, looked up in the job index."""
        from kiln.storage.id_prefix import job_ids_with_prefix
        from kiln.storage.keys import valid_id

        store = self.store
        return resolve_id(
            "job",
            job_id,
            lambda given: valid_id(given) and bool(store.redis.exists(store.keys.job(given))),
            lambda prefix, limit: job_ids_with_prefix(store.redis, store.keys, prefix, None, limit),
        )

    def page(
        self, status: str | None, batch_id: str | None, cursor: str | None, limit: int
    ) -> JobPage:
        """A page read from the store's indexes (every owner's jobs: Redis access is trusted)."""
        state = JobState(status) if status is not None else None
        try:
            records, next_cursor = self.store.list_jobs(
                state=state, batch_id=batch_id, cursor=cursor, limit=limit
            )
        except ValueError as exc:
            raise UsageError(f"--cursor {cursor!r}: {exc}") from exc
        return [job_view(record, self.objects) for record in records], next_cursor

    def download(self, view: JobView, folder: Path) -> DownloadReport:
        """Read each output from the store its record names (a folder, or an S3 bucket)."""
        from kiln.tasks.client.batch_downloads import download_outputs, job_output_files

        outputs = self.store.get(view.id).outputs
        return download_outputs(
            job_output_files(view, folder, read_of=lambda n: self._reader(outputs[n]))
        )

    def _reader(self, output: dict[str, Any]) -> Callable[[], Iterator[bytes]]:
        """A read of one output's bytes from its store; a store's failure as an OSError."""
        from kiln.storage.errors import StorageError
        from kiln.storage.objects import read_stream, store_named
        from kiln.tasks.contract.views import OUTPUT_STORAGE_URL

        def read() -> Iterator[bytes]:
            try:
                store = store_named(self.objects, output.get(OUTPUT_STORAGE_URL))
                yield from read_stream(
                    store, str(output["key"]), 0, int(output.get("bytes") or WHOLE)
                )
            except StorageError as exc:
                raise OSError(str(exc)) from exc

        return read

    def pipelines(self) -> list[str]:
        """What the submitter knows: configured pipelines and those live nodes announce."""
        return list(self.submitter.known_pipelines())

    def close(self) -> None:
        """Close the Redis connections."""
        self.store.redis.close()


class HttpBackend:
    """Talks to a Kiln API through `KilnClient`."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        # Deferred: httpx loads only when the CLI talks to an API.
        from kiln.tasks.client.client import KilnClient

        self.client = KilnClient(base_url, api_key=api_key)

    def submit(
        self,
        request: JobRequest,
        idempotency_key: str | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> JobView:
        """POST /v1/jobs."""
        given = trace or {}
        return self.client.submit(
            request,
            idempotency_key=idempotency_key,
            traceparent=given.get(TRACEPARENT),
            tracestate=given.get(TRACESTATE),
        )

    def get(self, job_id: str) -> JobView:
        """GET /v1/jobs/{id}."""
        return self.client.get(job_id)

    def cancel(self, job_id: str) -> CancelResult:
        """POST /v1/jobs/{id}/cancel."""
        return self.client.cancel(job_id)

    def pause(self, job_id: str) -> PauseResult:
        """POST /v1/jobs/{id}/pause."""
        return self.client.pause(job_id)

    def resume(self, job_id: str) -> ResumeResult:
        """POST /v1/jobs/{id}/resume."""
        return self.client.resume(job_id)

    def resolve(self, job_id: str) -> str:
        """The job a full id or unique prefix names: GET /v1/jobs?id_prefix=... if need be."""
        return resolve_id("job", job_id, self._exists, self._starting_with)

    def _exists(self, job_id: str) -> bool:
        from kiln.tasks.client.client import JobNotFoundError

        try:
            self.client.get(job_id)
        except JobNotFoundError:
            return False
        return True  # or another key's (403): the command itself says so

    def _starting_with(self, prefix: str, limit: int) -> list[str]:
        from kiln.tasks.client.client import ValidationFailed

        try:
            return [view.id for view in self.client.list(id_prefix=prefix, limit=limit).jobs]
        except ValidationFailed:  # an API from before `id_prefix`: full ids only
            return []

    def page(
        self, status: str | None, batch_id: str | None, cursor: str | None, limit: int
    ) -> JobPage:
        """GET /v1/jobs: the key's own jobs (an admin key's: everyone's)."""
        jobs = self.client.list(status=status, batch_id=batch_id, cursor=cursor, limit=limit)
        return jobs.jobs, jobs.next_cursor

    def download(self, view: JobView, folder: Path) -> DownloadReport:
        """GET /v1/jobs/{id}/outputs/{n} for each output, with the API key."""
        return self.client.download_outputs(view.id, folder)

    def pipelines(self) -> list[str]:
        """GET /v1/pipelines."""
        return self.client.pipelines().pipelines

    def close(self) -> None:
        """Close the client's connection pool (a kept-alive connection is not left to the GC)."""
        self.client.close()


def remote_args(parser: argparse.ArgumentParser, key_help: str = "bearer key for --api") -> None:
    """`--api URL` and `--api-key KEY`, their defaults in KILN_API_URL and KILN_API_KEY."""
    parser.add_argument(
        "--api",
        metavar="URL",
        help="use a remote Kiln API instead of Redis (default: KILN_API_URL, else Redis; "
        "--api '' for Redis)",
    )
    parser.add_argument("--api-key", metavar="KEY", help=f"{key_help} (default: KILN_API_KEY)")
