"""Python client of the Kiln HTTP API: typed results, one exception per kind of failure."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import httpx
from httpx_sse import EventSource

from kiln.tasks.client.batches import BatchCalls
from kiln.tasks.client.uploads import UploadCalls
from kiln.tasks.contract.backoff import doubling_delay
from kiln.tasks.contract.responses import (
    CancelResult,
    DrainResult,
    JobList,
    PipelineInfo,
    PurgeResult,
    QueueControl,
    QueueList,
    WebhookAttempts,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.states import is_terminal
from kiln.tasks.contract.views import EventView, JobView

# `wait` polls soon after submitting (short jobs finish fast), then backs off to `poll_s`
FIRST_POLL_S = 0.05


class KilnError(Exception):
    """Base of every client error."""


class KilnConnectionError(KilnError):
    """The API could not be reached (or the connection broke)."""


class WaitTimeout(KilnError):
    """`wait` ran out of time; `job` is the last view seen."""

    def __init__(self, job: JobView | None, timeout: float) -> None:
        status = job.status if job else "unknown"
        super().__init__(f"job still {status} after {timeout:g} s")
        self.job = job


class ApiError(KilnError):
    """The API answered with an error status; `detail` is its explanation."""

    def __init__(self, status_code: int, detail: Any) -> None:
        super().__init__(f"HTTP {status_code}: {_describe(detail)}")
        self.status_code = status_code
        self.detail = detail


class Unauthorized(ApiError):
    """401: missing, unknown or revoked API key."""


class Forbidden(ApiError):
    """403: the job belongs to another API key."""


class JobNotFoundError(ApiError):
    """404: no such job."""


class IdempotencyConflictError(ApiError):
    """409: the Idempotency-Key was used with another request body."""


class PayloadTooLarge(ApiError):
    """413: the request body is over the server's limit."""


class ValidationFailed(ApiError):
    """422: invalid fields; `fields` maps each field path (e.g. `body.width`) to its message."""

    @property
    def fields(self) -> dict[str, str]:
        """Field path → message."""
        if not isinstance(self.detail, list):
            return {}
        return {".".join(str(p) for p in e.get("loc", [])): e.get("msg", "") for e in self.detail}


class QueueFull(ApiError):
    """429: admission control; retry after `retry_after` seconds."""

    def __init__(self, status_code: int, detail: Any, retry_after: float | None) -> None:
        super().__init__(status_code, detail)
        self.retry_after = retry_after


_ERRORS: dict[int, type[ApiError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: JobNotFoundError,
    409: IdempotencyConflictError,
    413: PayloadTooLarge,
    422: ValidationFailed,
}


def _describe(detail: Any) -> str:
    if isinstance(detail, list):
        return "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', []))}: {e.get('msg')}" for e in detail
        )
    return str(detail)


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        detail = response.json().get("detail", response.text)
    except (ValueError, AttributeError):
        detail = response.text
    code = response.status_code
    if code == 429:
        after = response.headers.get("retry-after")
        raise QueueFull(code, detail, float(after) if after and after.isdigit() else None)
    raise _ERRORS.get(code, ApiError)(code, detail)


class KilnClient(BatchCalls, UploadCalls):
    """A Kiln API: `submit`, `get`, `wait`, `cancel`, `events`, `list`, `webhooks`, `pipeline`.

    Batches (`BatchCalls`): `submit_batch`, `get_batch`, `list_batches`, `cancel_batch`,
    `pause_batch`, `resume_batch`, `retry_batch`, `batch_events`, `batch_results`,
    `download_batch_results`, `wait_batch`. Inputs (`UploadCalls`): `upload`.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> KilnClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise KilnConnectionError(f"{method} {path}: {exc}") from exc
        _raise_for(response)
        return response

    def submit(
        self, request: JobRequest | dict[str, Any], *, idempotency_key: str | None = None
    ) -> JobView:
        """Enqueue a job; the same idempotency key and body return the same job."""
        body = request.model_dump(mode="json") if isinstance(request, JobRequest) else request
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return JobView.model_validate(
            self._call("POST", "/v1/jobs", json=body, headers=headers).json()
        )

    def get(self, job_id: str) -> JobView:
        """The job's current view (output URLs presigned now)."""
        return JobView.model_validate(self._call("GET", f"/v1/jobs/{job_id}").json())

    def cancel(self, job_id: str) -> CancelResult:
        """Cancel the job; the result says whether it took effect at once."""
        return CancelResult.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel").json())

    def list(
        self,
        *,
        status: str | None = None,
        batch_id: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
        id_prefix: str | None = None,
    ) -> JobList:
        """One page of the caller's jobs, newest first (`id_prefix`: only ids starting so)."""
        params = {
            "status": status,
            "batch_id": batch_id,
            "cursor": cursor,
            "limit": limit,
            "id_prefix": id_prefix,
        }
        clean = {k: v for k, v in params.items() if v is not None}
        return JobList.model_validate(self._call("GET", "/v1/jobs", params=clean).json())

    def pipeline(self, name: str) -> PipelineInfo:
        """What a pipeline takes: its input schema (for `JobRequest.inputs`), limits, adapters."""
        return PipelineInfo.model_validate(self._call("GET", f"/v1/pipelines/{name}").json())

    def webhooks(self, job_id: str) -> WebhookAttempts:
        """The job's webhook delivery attempts."""
        return WebhookAttempts.model_validate(
            self._call("GET", f"/v1/jobs/{job_id}/webhooks").json()
        )

    def events(self, job_id: str, *, after: int = 0) -> Iterator[EventView]:
        """The job's events as they happen (SSE), from after `after`; ends after the terminal one.

        A dropped connection, or a stream the server ended before the terminal event (its
        lifetime, KILN_SSE_MAX_LIFETIME_S), is resumed from the last seq seen (`Last-Event-ID`).
        """
        last = after
        while True:
            try:
                start = last
                for event in self._stream(job_id, last):
                    last = event.seq
                    yield event
                    if is_terminal(event.type):
                        return
                if last == start and is_terminal(self.get(job_id).status):
                    return  # nothing after `start` and the job is over: its end came before
                after = last  # ended early by the server: resume where it stopped
                continue
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if last == after:
                    raise KilnConnectionError(f"event stream of {job_id} broke: {exc}") from exc
                after = last  # progress was made: resume once more from where it broke

    def _stream(self, job_id: str, after: int) -> Iterator[EventView]:
        headers = {"Last-Event-ID": str(after), "Accept": "text/event-stream"}
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)
        try:
            with self._http.stream(
                "GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=timeout
            ) as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                for event in EventSource(response).iter_sse():
                    if not event.data:
                        # a comment's blank line (keep-alive, end): httpx-sse dispatches it once
                        # an id was seen, where the SSE spec dispatches no event without data
                        continue
                    yield EventView.model_validate_json(event.data)
        except httpx.ConnectError as exc:
            raise KilnConnectionError(f"events of {job_id}: {exc}") from exc

    # --- operator controls (admin keys) ------------------------------------------------------
    def queues(self) -> QueueList:
        """Every queue with its queued jobs and whether it is paused."""
        return QueueList.model_validate(self._call("GET", "/v1/admin/queues").json())

    def pause_queue(self, queue: str) -> QueueControl:
        """Pause `queue` (`<lane>.<pipeline>`) on every node."""
        return QueueControl.model_validate(
            self._call("POST", f"/v1/admin/queues/{queue}/pause").json()
        )

    def resume_queue(self, queue: str) -> QueueControl:
        """Resume a paused queue."""
        return QueueControl.model_validate(
            self._call("POST", f"/v1/admin/queues/{queue}/resume").json()
        )

    def purge_queue(self, queue: str) -> PurgeResult:
        """Cancel every job queued in `queue`."""
        return PurgeResult.model_validate(
            self._call("POST", f"/v1/admin/queues/{queue}/purge").json()
        )

    def drain_node(self, node_id: str, *, exit: bool = False) -> DrainResult:
        """Ask a node to finish its jobs and take no more (then exit, with `exit`)."""
        params = {"exit": "true" if exit else "false"}
        response = self._call("POST", f"/v1/admin/nodes/{node_id}/drain", params=params)
        return DrainResult.model_validate(response.json())

    def undrain_node(self, node_id: str) -> DrainResult:
        """Withdraw a node's drain request."""
        return DrainResult.model_validate(
            self._call("DELETE", f"/v1/admin/nodes/{node_id}/drain").json()
        )

    def wait(self, job_id: str, timeout: float = 600.0, poll_s: float = 1.0) -> JobView:
        """Block until the job is finished; raises `WaitTimeout` with the last view seen."""
        deadline = time.monotonic() + timeout
        job, polls = self.get(job_id), 0
        while not is_terminal(job.status):
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(job, timeout)
            polls += 1
            time.sleep(min(doubling_delay(polls, min(FIRST_POLL_S, poll_s), poll_s), left))
            job = self.get(job_id)
        return job
