"""Where the CLI's job commands go: straight to Redis, or to a remote Kiln API."""

from __future__ import annotations

from typing import Protocol

from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.contract.views import JobView, job_view


class JobsBackend(Protocol):
    """The three job operations the CLI needs."""

    def submit(self, request: JobRequest, idempotency_key: str | None = None) -> JobView:
        """Submit a job (once per `idempotency_key`); the job's view."""
        ...

    def get(self, job_id: str) -> JobView:
        """The job's view."""
        ...

    def cancel(self, job_id: str) -> JobView:
        """Request the job's cancellation; the job's view after it."""
        ...


class DirectBackend:
    """Talks to Redis and the object store directly (same settings as the workers)."""

    def __init__(self) -> None:
        # Deferred: Redis, boto3 and Celery load only when the CLI talks to Redis directly.
        from kiln.storage.objects import open_object_store
        from kiln.storage.settings import StorageSettings
        from kiln.storage.status import JobStore
        from kiln.tasks.queue.submit import Submitter

        storage_settings = StorageSettings()
        self.store = JobStore.from_settings(storage_settings)
        self.objects = open_object_store(storage_settings)
        self.submitter = Submitter(self.store, KilnSettings())

    def submit(self, request: JobRequest, idempotency_key: str | None = None) -> JobView:
        """Accept a job; an idempotent repeat returns the existing one."""
        record, _ = self.submitter.submit(request, idempotency_key=idempotency_key)
        return job_view(record, self.objects, self.submitter.live_pipelines())

    def get(self, job_id: str) -> JobView:
        """The job's current view; a queued job's position and expected start."""
        from kiln.tasks.queue.positions import queue_estimate

        record = self.store.get(job_id)
        estimate = queue_estimate(self.store, record, self.submitter.settings.bulk_share_every)
        return job_view(record, self.objects, self.submitter.live_pipelines(), estimate)

    def cancel(self, job_id: str) -> JobView:
        """Cancel (queued: at once; running: at its next step)."""
        return job_view(self.store.cancel(job_id), self.objects)


class HttpBackend:
    """Talks to a Kiln API through `KilnClient`."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        # Deferred: httpx loads only when the CLI talks to an API.
        from kiln.tasks.client.client import KilnClient

        self.client = KilnClient(base_url, api_key=api_key)

    def submit(self, request: JobRequest, idempotency_key: str | None = None) -> JobView:
        """POST /v1/jobs."""
        return self.client.submit(request, idempotency_key=idempotency_key)

    def get(self, job_id: str) -> JobView:
        """GET /v1/jobs/{id}."""
        return self.client.get(job_id)

    def cancel(self, job_id: str) -> JobView:
        """POST /v1/jobs/{id}/cancel."""
        return self.client.cancel(job_id).job
