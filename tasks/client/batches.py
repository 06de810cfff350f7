"""The batch calls of `KilnClient` (a mixin): submit, follow, control, results, downloads.

An upload streams from a file (or an iterable of requests) without reading it whole; results
stream back line by line. A refused file raises `ValidationFailed`, whose `detail` opens with the
counts (`batch_invalid`) and then lists the first errors by line. `batch_events` follows a batch
over server-sent events (`batch.progress`, then one terminal `batch.<status>`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import EventSource

from kiln.tasks.client.batch_downloads import (
    DEFAULT_DOWNLOAD_WORKERS,
    DownloadReport,
    download_outputs,
    output_files,
)
from kiln.tasks.contract.batches import (
    BATCHES_PATH,
    DEFAULT_COMPLETION_WINDOW,
    BatchList,
    BatchResult,
    BatchSummary,
    BatchView,
    RetryInclude,
    is_final_batch,
)
from kiln.tasks.contract.schemas import JobRequest

UPLOAD_CHUNK = 256 * 1024
BatchLine = BatchResult | BatchSummary
BatchSource = str | Path | Iterable[JobRequest | dict[str, Any]]
RETRY_INCLUDE = tuple(RetryInclude)


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


class BatchCalls:
    """Batch methods of `KilnClient` (which provides `_http` and `_call`)."""

    _http: httpx.Client

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        raise NotImplementedError  # KilnClient's: sends, raises the API's errors

    def submit_batch(
        self,
        source: BatchSource,
        *,
        pipeline: str | None = None,
        priority: str = "bulk",
        completion_window: str = DEFAULT_COMPLETION_WINDOW,
        skip_invalid: bool = False,
        metadata: dict[str, str] | None = None,
        webhook_url: str | None = None,
        webhook_events: list[str] | None = None,
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
            headers={"Content-Type": "application/x-ndjson"},
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
        """Stop feeding the batch (jobs already queued or running go on); `resume_batch` undoes."""
        response = self._call("POST", f"{BATCHES_PATH}/{batch_id}/pause")
        return BatchView.model_validate(response.json())

    def resume_batch(self, batch_id: str) -> BatchView:
        """Feed a paused batch again."""
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
        from kiln.tasks.client.client import KilnConnectionError, _raise_for

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
