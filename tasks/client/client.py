"""Python client of the Kiln HTTP API: one session, typed results, one exception per failure.

`KilnClient` is the whole session over one connection pool: jobs, uploads, batches, queues and
nodes. An upload (`upload`) posts for a slot, then PUTs the bytes where the API says: a presigned
object-store URL (sent without the API key: the signature is the credential) or, for a local
store, the API's own PUT (sent with it); the slot's `ref` (`upload:<id>`) names it in a job's
image input. A batch streams from a file (or an iterable of requests) without reading it whole,
and its results stream back line by line. A refused batch file raises `ValidationFailed`, whose
`detail` opens with the counts (`batch_invalid`) and then lists the first errors by line.
`batch_events` follows a batch over server-sent events (`batch.progress`, then one terminal
`batch.<status>`).
"""

from __future__ import annotations

import base64
import json
import mimetypes
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
from httpx_sse import EventSource

from kiln.common.defaults import BATCH_LANE
from kiln.common.media import BATCH_INPUT_CONTENT_TYPE
from kiln.common.states import is_final_batch, is_terminal
from kiln.common.tracing import current_carrier, given_carrier
from kiln.tasks.client.batch_downloads import (
    DEFAULT_DOWNLOAD_WORKERS,
    DownloadReport,
    download_outputs,
    job_output_files,
    output_files,
)
from kiln.tasks.contract.backoff import doubling_delay
from kiln.tasks.contract.batches import (
    BATCHES_PATH,
    DEFAULT_COMPLETION_WINDOW,
    BatchList,
    BatchResult,
    BatchSummary,
    BatchView,
    RetryInclude,
)
from kiln.tasks.contract.dead_letters import (
    DeadLetterList,
    DeadLetterView,
    RedriveRequest,
    RedriveResult,
)
from kiln.tasks.contract.events import preview_of
from kiln.tasks.contract.responses import (
    CancelResult,
    DrainResult,
    JobList,
    NodeList,
    PauseResult,
    PipelineInfo,
    PipelineList,
    PurgeResult,
    QueueControl,
    QueueList,
    ResumeResult,
    WebhookAttempts,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.upload_slots import UPLOADS_PATH, UploadSlotView
from kiln.tasks.contract.usage import UsageReport
from kiln.tasks.contract.views import EventView, JobView, PreviewData, PreviewEvent

# `wait` polls soon after submitting (short jobs finish fast), then backs off to `poll_s`
FIRST_POLL_S = 0.05
UPLOAD_CHUNK = 256 * 1024
BatchLine = BatchResult | BatchSummary
BatchSource = str | Path | Iterable[JobRequest | dict[str, Any]]
RETRY_INCLUDE = tuple(RetryInclude)

UploadSource = str | Path | bytes
# Magic numbers of the formats an image input may have.
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))


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


class UploadFailed(RuntimeError):
    """The object store refused the PUT of an upload (the slot was granted)."""


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


def sniff_content_type(data: bytes, name: str | None = None) -> str:
    """The content type of an image by its first bytes, else by its file name."""
    for signature, content_type in _SIGNATURES:
        if data.startswith(signature):
            return content_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    guessed = mimetypes.guess_type(name)[0] if name else None
    return guessed or "application/octet-stream"


def _file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(UPLOAD_CHUNK):
            yield chunk


def _request_lines(requests: Iterable[JobRequest | dict[str, Any]]) -> Iterator[bytes]:
    buffer = bytearray()
    for index, request in enumerate(requests):
        if isinstance(request, JobRequest):
            raise TypeError(
                f"request {index}: a batch line needs a custom_id; pass a dict such as "
                "{'custom_id': ..., **request.model_dump(exclude_none=True)}"
            )
        buffer += json.dumps(request, separators=(",", ":")).encode() + b"\n"
        if len(buffer) >= UPLOAD_CHUNK:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)


def batch_body(source: BatchSource) -> Iterator[bytes]:
    """The body of a batch upload: a JSONL file's bytes, or one JSON line per request dict."""
    if isinstance(source, str | Path):
        return _file_chunks(Path(source))
    return _request_lines(source)


def parse_batch_line(raw: str | bytes) -> BatchLine:
    """One line of a batch's results: a `BatchResult`, or the final `BatchSummary`."""
    data = json.loads(raw)
    if data.get("type") == "summary":
        return BatchSummary.model_validate(data)
    return BatchResult.model_validate(data)


def preview_image(data: PreviewData, timeout: httpx.Timeout | float = 10.0) -> bytes | None:
    """A preview's image: decoded from its event, or fetched from its URL; None if it is gone."""
    try:
        if data.image_b64 is not None:
            return base64.b64decode(data.image_b64, validate=True)
        if data.url is not None and data.url.startswith("file://"):
            return Path(urllib.parse.unquote(urllib.parse.urlsplit(data.url).path)).read_bytes()
        if data.url is not None:
            # a presigned object URL: no API key goes to the object store
            response = httpx.get(data.url, timeout=timeout)
            response.raise_for_status()
            return response.content
    except (ValueError, OSError, httpx.HTTPError):
        return None  # replaced or expired meanwhile: a newer preview follows
    return None


class KilnClient:
    """A Kiln API session.

    Jobs: `submit`, `get`, `wait`, `cancel`, `events`, `list`, `webhooks`, `pipeline`,
    `pipelines`, `output_url`, `download_outputs`. Inputs: `upload`. Batches: `submit_batch`,
    `get_batch`, `list_batches`, `cancel_batch`, `pause_batch`, `resume_batch`, `retry_batch`,
    `batch_events`, `batch_results`, `download_batch_results`, `wait_batch`. Operators: `nodes`,
    `queues`, `pause_queue`, `resume_queue`, `purge_queue`,
    `drain_node`, `undrain_node`, `dead_letters`, `dead_letter`, `redrive`.
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

    @property
    def base_url(self) -> str:
        """The API's address, as given (no trailing slash)."""
        return str(self._http.base_url).rstrip("/")

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
        self,
        request: JobRequest | dict[str, Any],
        *,
        idempotency_key: str | None = None,
        traceparent: str | None = None,
        tracestate: str | None = None,
    ) -> JobView:
        """Enqueue a job; the same idempotency key and body return the same job.

        `traceparent` (and `tracestate`): the W3C trace context the job's trace continues; by
        default the caller's current OpenTelemetry span's, if it has one.
        """
        body = request.model_dump(mode="json") if isinstance(request, JobRequest) else request
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        headers.update(given_carrier(traceparent, tracestate) or current_carrier())
        return JobView.model_validate(
            self._call("POST", "/v1/jobs", json=body, headers=headers).json()
        )

    def get(self, job_id: str) -> JobView:
        """The job's current view (output URLs presigned now)."""
        return JobView.model_validate(self._call("GET", f"/v1/jobs/{job_id}").json())

    def cancel(self, job_id: str) -> CancelResult:
        """Cancel the job; the result says whether it took effect at once."""
        return CancelResult.model_validate(self._call("POST", f"/v1/jobs/{job_id}/cancel").json())

    def pause(self, job_id: str) -> PauseResult:
        """Pause the job (a running one at its next step); ApiError 409 for a finished one."""
        return PauseResult.model_validate(self._call("POST", f"/v1/jobs/{job_id}/pause").json())

    def resume(self, job_id: str) -> ResumeResult:
        """Resume a paused job (queued again); ApiError 409 for a finished one."""
        return ResumeResult.model_validate(self._call("POST", f"/v1/jobs/{job_id}/resume").json())

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

    def output_url(self, job_id: str, index: int) -> str:
        """Where the API serves output `index` (0-based) of the job: `/v1/jobs/{id}/outputs/{n}`."""
        return f"{self.base_url}/v1/jobs/{job_id}/outputs/{index}"

    def download_outputs(
        self, job_id: str, folder: str | Path, *, workers: int = DEFAULT_DOWNLOAD_WORKERS
    ) -> DownloadReport:
        """Fetch the job's outputs through the API into `folder/<job id>-<n>.<ext>`.

        Each is verified against the sha256 its record names; files already there with it are
        kept. A job with no outputs (not finished, or failed) fetches nothing.
        """
        view = self.get(job_id)
        files = job_output_files(view, Path(folder), lambda n, _url: self.output_url(view.id, n))
        return download_outputs(files, workers=workers, headers=dict(self._http.headers))

    def pipeline(self, name: str) -> PipelineInfo:
        """What a pipeline takes: its input schema (for `JobRequest.inputs`), limits, adapters."""
        return PipelineInfo.model_validate(self._call("GET", f"/v1/pipelines/{name}").json())

    def pipelines(self) -> PipelineList:
        """The pipelines the API accepts jobs for (configured or served by a live node)."""
        return PipelineList.model_validate(self._call("GET", "/v1/pipelines").json())

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
                    if event.type == "preview":
                        preview = self._preview_event(event)
                        if preview is not None:
                            yield preview
                        continue
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

    def _preview_event(self, event: EventView) -> PreviewEvent | None:
        """A preview with its image's bytes; None when they cannot be had (a newer one comes)."""
        image = preview_image(preview_of(event), self._http.timeout)
        if image is None:
            return None
        return PreviewEvent(**event.model_dump(), image=image)

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
    def nodes(self) -> NodeList:
        """Live nodes from their heartbeats, paused queues and pending drain requests."""
        return NodeList.model_validate(self._call("GET", "/v1/nodes").json())

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

    def dead_letters(
        self, *, owner: str | None = None, cursor: str | None = None, limit: int = 50
    ) -> DeadLetterList:
        """One page of dead letters (failed jobs), newest first; `owner`: admin keys only."""
        params = {"owner": owner, "cursor": cursor, "limit": limit}
        clean = {k: v for k, v in params.items() if v is not None}
        return DeadLetterList.model_validate(
            self._call("GET", "/v1/dead-letters", params=clean).json()
        )

    def usage(
        self, *, since: str | None = None, until: str | None = None, group_by: str = "key"
    ) -> UsageReport:
        """GPU-seconds, energy and attempts per key or pipeline over [since, until).

        `since`/`until`: epoch seconds, ISO 8601 or a duration back from now (`24h`); a key sees
        its own totals, an admin key every key's and the nodes' own.
        """
        params = {"since": since, "until": until, "group_by": group_by}
        clean = {k: v for k, v in params.items() if v is not None}
        return UsageReport.model_validate(self._call("GET", "/v1/usage", params=clean).json())

    def dead_letter(self, job_id: str) -> DeadLetterView:
        """One failed job's dead letter: its request, every attempt, its error."""
        return DeadLetterView.model_validate(self._call("GET", f"/v1/dead-letters/{job_id}").json())

    def redrive(self, request: RedriveRequest, timeout: float = 180.0) -> RedriveResult:
        """Make new jobs of dead letters at `request.rate` per second (the call waits for all)."""
        body = request.model_dump(mode="json", exclude_none=True)
        return RedriveResult.model_validate(
            self._call("POST", "/v1/dead-letters/redrive", json=body, timeout=timeout).json()
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

    # --- uploads ---------------------------------------------------------------------------------
    def upload(
        self, source: UploadSource, *, content_type: str | None = None, purpose: str = "image"
    ) -> UploadSlotView:
        """Upload a file (path) or bytes; returns the slot, whose `ref` a job's input names."""
        name = None if isinstance(source, bytes) else str(source)
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        content_type = content_type or sniff_content_type(data, name)
        body = {"content_type": content_type, "bytes": len(data), "purpose": purpose}
        slot = UploadSlotView.model_validate(self._call("POST", UPLOADS_PATH, json=body).json())
        if slot.url.startswith(str(self._http.base_url)):
            self._call("PUT", slot.url, content=data, headers=slot.headers)
            return slot
        try:  # a presigned URL: no API key goes to the object store
            answer = httpx.put(slot.url, content=data, headers=slot.headers, timeout=60.0)
        except httpx.TransportError as exc:
            raise UploadFailed(f"PUT of upload {slot.upload_id} failed: {exc}") from exc
        if not answer.is_success:
            raise UploadFailed(f"PUT of upload {slot.upload_id}: HTTP {answer.status_code}")
        return slot

    # --- batches ---------------------------------------------------------------------------------
    def submit_batch(
        self,
        source: BatchSource,
        *,
        pipeline: str | None = None,
        priority: str = BATCH_LANE,
        completion_window: str = DEFAULT_COMPLETION_WINDOW,
        skip_invalid: bool = False,
        metadata: dict[str, str] | None = None,
        webhook_url: str | None = None,
        webhook_events: Sequence[str] | None = None,
        timeout: float | None = None,
    ) -> BatchView:
        """Upload a batch (a JSONL file path, or dicts each with a `custom_id`), streamed."""
        params: dict[str, Any] = {
            "priority": priority,
            "completion_window": completion_window,
            "skip_invalid": "true" if skip_invalid else "false",
        }
        if pipeline is not None:
            params["pipeline"] = pipeline
        if metadata:
            params["metadata"] = json.dumps(metadata)
        if webhook_url is not None:
            params["webhook_url"] = webhook_url
        if webhook_events:
            params["webhook_events"] = ",".join(webhook_events)
        options: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        response = self._call(
            "POST",
            BATCHES_PATH,
            params=params,
            content=batch_body(source),
            headers={"Content-Type": BATCH_INPUT_CONTENT_TYPE},
            **options,
        )
        return BatchView.model_validate(response.json())

    def get_batch(self, batch_id: str) -> BatchView:
        """The batch's current view (status, counts, throughput, ETA)."""
        return BatchView.model_validate(self._call("GET", f"{BATCHES_PATH}/{batch_id}").json())

    def list_batches(
        self, *, cursor: str | None = None, limit: int = 50, id_prefix: str | None = None
    ) -> BatchList:
        """One page of the caller's batches, newest first (`id_prefix`: only ids starting so)."""
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        if id_prefix is not None:
            params["id_prefix"] = id_prefix
        return BatchList.model_validate(self._call("GET", BATCHES_PATH, params=params).json())

    def cancel_batch(self, batch_id: str) -> BatchView:
        """Stop feeding the batch; its queued jobs are canceled, running ones at the next step."""
        response = self._call("POST", f"{BATCHES_PATH}/{batch_id}/cancel")
        return BatchView.model_validate(response.json())

    def pause_batch(self, batch_id: str) -> BatchView:
        """Stop feeding the batch and pause its lines' jobs; `resume_batch` undoes both."""
        response = self._call("POST", f"{BATCHES_PATH}/{batch_id}/pause")
        return BatchView.model_validate(response.json())

    def resume_batch(self, batch_id: str) -> BatchView:
        """Feed a paused batch again and resume its paused lines."""
        response = self._call("POST", f"{BATCHES_PATH}/{batch_id}/resume")
        return BatchView.model_validate(response.json())

    def retry_batch(self, batch_id: str, include: Iterable[str] = RETRY_INCLUDE) -> BatchView:
        """A new batch (`parent_id`: this one) of the finished batch's failed/expired lines."""
        params = {"include": ",".join(include)}
        response = self._call("POST", f"{BATCHES_PATH}/{batch_id}/retry", params=params)
        return BatchView.model_validate(response.json())

    def batch_events(self, batch_id: str) -> Iterator[BatchView]:
        """The batch's view at each change (SSE); ends after the final one.

        A stream the server ends early (its lifetime, KILN_SSE_MAX_LIFETIME_S) is opened again.
        """
        headers = {"Accept": "text/event-stream"}
        while True:
            for response in self._open_stream(f"/{batch_id}/events", headers):
                for event in EventSource(response).iter_sse():
                    if not event.data:  # a comment (keep-alive, end): no event, per the SSE spec
                        continue
                    view = BatchView.model_validate_json(event.data)
                    yield view
                    if is_final_batch(view.status):
                        return

    def batch_results_raw(self, batch_id: str) -> Iterator[bytes]:
        """The batch's result lines so far, as JSONL bytes (newline-terminated), streamed."""
        for line in self._stream_lines(f"/{batch_id}/results"):
            if line.strip():
                yield line.encode() + b"\n"

    def _stream_lines(self, suffix: str, headers: dict[str, str] | None = None) -> Iterator[str]:
        """The lines of a streamed GET under /v1/batches."""
        for response in self._open_stream(suffix, headers):
            yield from response.iter_lines()

    def _open_stream(
        self, suffix: str, headers: dict[str, str] | None = None
    ) -> Iterator[httpx.Response]:
        """The open response of a streamed GET under /v1/batches, yielded once.

        No read timeout: the stream may be long. A refusal raises as `_call` does.
        """
        path = f"{BATCHES_PATH}{suffix}"
        timeout = httpx.Timeout(self._http.timeout.connect, read=None)
        try:
            with self._http.stream("GET", path, headers=headers, timeout=timeout) as response:
                if not response.is_success:
                    response.read()
                    _raise_for(response)
                yield response
        except httpx.TransportError as exc:
            raise KilnConnectionError(f"GET {path}: {exc}") from exc

    def download_batch_results(
        self, batch_id: str, folder: str | Path, *, workers: int = DEFAULT_DOWNLOAD_WORKERS
    ) -> DownloadReport:
        """Download every output so far into `folder/<custom_id>/<file>`, sha256-verified.

        Files already there with the right sha256 are kept: calling it again resumes.
        """
        results = (line for line in self.batch_results(batch_id) if isinstance(line, BatchResult))
        return download_outputs(output_files(results, Path(folder)), workers=workers)

    def batch_results(self, batch_id: str) -> Iterator[BatchLine]:
        """The batch's result lines so far, parsed; a finished batch's last one is the summary."""
        for raw in self.batch_results_raw(batch_id):
            yield parse_batch_line(raw)

    def wait_batch(self, batch_id: str, timeout: float = 3600.0, poll_s: float = 1.0) -> BatchView:
        """Block until the batch is finished; raises `TimeoutError` with the last view seen."""
        deadline = time.monotonic() + timeout
        view = self.get_batch(batch_id)
        while not is_final_batch(view.status):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"batch {batch_id} still {view.status} after {timeout:g} s")
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
            view = self.get_batch(batch_id)
        return view
