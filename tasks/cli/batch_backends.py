"""Where `kiln batch` commands go: Redis and the object store directly, or a Kiln API.

`DirectBatches` uses the workers' own settings (as `kiln submit` does) and validates a file line
by line with the API's rules; `HttpBatches` goes through `KilnClient`. Only the API has a batch
event stream: without it a batch is followed by polling Redis.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kiln.tasks.cli.exits import UsageError
from kiln.tasks.cli.short_ids import resolve_id
from kiln.tasks.contract.batches import BatchList, BatchView


class BatchRefused(Exception):
    """The file was refused: its first errors (each with `line`) and the counts."""

    def __init__(self, errors: list[dict[str, Any]], invalid: int, lines: int) -> None:
        super().__init__(f"batch refused: {invalid} of {lines} lines are invalid")
        self.errors = errors
        self.invalid = invalid
        self.lines = lines


@dataclass(frozen=True)
class SubmitOptions:
    """What `kiln batch submit` passes on."""

    pipeline: str | None
    priority: str
    completion_window: str
    skip_invalid: bool
    metadata: dict[str, str]


class BatchBackend(Protocol):
    """Where batch commands go."""

    def submit(self, path: Path, options: SubmitOptions) -> BatchView:
        """Validate and accept the file; raises BatchRefused."""
        ...

    def get(self, batch_id: str) -> BatchView:
        """The batch's view."""
        ...

    def list(self, cursor: str | None, limit: int) -> BatchList:
        """A page of batches."""
        ...

    def cancel(self, batch_id: str) -> BatchView:
        """Cancel the batch; its view after."""
        ...

    def results(self, batch_id: str) -> Iterator[bytes]:
        """The result lines so far (newline-terminated)."""
        ...

    def pause(self, batch_id: str) -> BatchView:
        """Stop feeding the batch; its view after."""
        ...

    def resume(self, batch_id: str) -> BatchView:
        """Feed the batch again; its view after."""
        ...

    def retry(self, batch_id: str, include: Iterable[str]) -> BatchView:
        """A new batch of the lines that ended in `include` states; the new batch's view."""
        ...

    def events(self, batch_id: str) -> Iterator[BatchView] | None:
        """The batch's view at each change until it ends, or None where only polling works."""
        ...

    def resolve(self, batch_id: str) -> str:
        """The full id of `batch_id`, which may be a unique prefix (`cli.short_ids`)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class DirectBatches:
    """Batches straight in Redis and the object store (the same settings as the workers)."""

    def __init__(self) -> None:
        # Deferred: Redis, boto3, Celery and the API's JSON checks load only here.
        from kiln.tasks.api.json_guard import body_errors
        from kiln.tasks.batches.service import BatchService
        from kiln.tasks.queue.process import ProcessParts
        from kiln.tasks.queue.submit import Submitter

        parts = ProcessParts()  # the command's process: its environment, read once
        settings, store = parts.settings, parts.store
        depth = settings.max_json_depth
        self.service = BatchService(
            store,
            parts.objects,
            Submitter(store, settings, publish=lambda *_args, **_kw: None),
            settings,
            lambda raw: body_errors(raw, depth),
        )

    def submit(self, path: Path, options: SubmitOptions) -> BatchView:
        """Validate the file here while it streams to the object store, then record it."""
        from kiln.tasks.batches.intake import LineDefaults
        from kiln.tasks.batches.service import BatchOptions
        from kiln.tasks.batches.views import batch_view
        from kiln.tasks.contract.batches import parse_completion_window

        try:
            window_s = parse_completion_window(options.completion_window)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        defaults = LineDefaults(
            pipeline=options.pipeline, priority=options.priority, metadata=options.metadata
        )
        batch, report = self.service.submit_lines(
            _file_chunks(path), BatchOptions(defaults, window_s, options.skip_invalid)
        )
        if batch is None:
            raise BatchRefused(report.errors, report.invalid, report.lines)
        return batch_view(batch)

    def get(self, batch_id: str) -> BatchView:
        """The batch's view, from Redis."""
        from kiln.tasks.batches.views import batch_view

        return batch_view(self.service.get(batch_id))

    def list(self, cursor: str | None, limit: int) -> BatchList:
        """Every batch, newest first."""
        from kiln.tasks.batches.views import batch_view

        batches, next_cursor = self.service.list(None, cursor, limit)
        return BatchList(batches=[batch_view(b) for b in batches], next_cursor=next_cursor)

    def cancel(self, batch_id: str) -> BatchView:
        """Ask the batch to stop (the feeders wind it down)."""
        from kiln.tasks.batches.views import batch_view

        return batch_view(self.service.cancel(batch_id))

    def results(self, batch_id: str) -> Iterator[bytes]:
        """The result lines, read from the object store."""
        return self.service.results(batch_id)

    def pause(self, batch_id: str) -> BatchView:
        """Stop feeding the batch."""
        from kiln.tasks.batches.views import batch_view

        return batch_view(self.service.pause(batch_id))

    def resume(self, batch_id: str) -> BatchView:
        """Feed a paused batch again."""
        from kiln.tasks.batches.views import batch_view

        return batch_view(self.service.resume(batch_id))

    def retry(self, batch_id: str, include: Iterable[str]) -> BatchView:
        """A new batch of the finished batch's lines that ended in `include`."""
        from kiln.tasks.batches.retry import NothingToRetry
        from kiln.tasks.batches.views import batch_view

        try:
            return batch_view(self.service.retry(batch_id, frozenset(include)))
        except NothingToRetry as exc:
            raise UsageError(str(exc)) from exc

    def events(self, batch_id: str) -> Iterator[BatchView] | None:
        """No event stream without the API: the caller polls Redis."""
        del batch_id  # the protocol's signature
        return None

    def resolve(self, batch_id: str) -> str:
        """The batch a full id or unique prefix names, looked up in the batch index."""
        from kiln.storage.id_prefix import batch_ids_with_prefix
        from kiln.storage.keys import valid_id

        batches = self.service.batches
        return resolve_id(
            "batch",
            batch_id,
            lambda given: valid_id(given) and bool(batches.redis.exists(batches.keys.batch(given))),
            lambda prefix, limit: batch_ids_with_prefix(
                batches.redis, batches.keys, prefix, None, limit
            ),
        )

    def close(self) -> None:
        """Close the Redis connections."""
        self.service.store.redis.close()


class HttpBatches:
    """Batches through a Kiln API (`KilnClient`)."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        # Deferred: httpx loads only when the CLI talks to an API.
        from kiln.tasks.client.client import KilnClient

        self.client = KilnClient(base_url, api_key=api_key, timeout=300.0)

    def submit(self, path: Path, options: SubmitOptions) -> BatchView:
        """POST /v1/batches, the file streamed."""
        from kiln.tasks.client.client import ValidationFailed

        try:
            return self.client.submit_batch(
                path,
                pipeline=options.pipeline,
                priority=options.priority,
                completion_window=options.completion_window,
                skip_invalid=options.skip_invalid,
                metadata=options.metadata or None,
            )
        except ValidationFailed as exc:
            detail = exc.detail if isinstance(exc.detail, list) else []
            if not detail or detail[0].get("type") not in ("batch_invalid", "batch_empty"):
                raise
            counts = detail[0].get("ctx") or {}
            errors = [e for e in detail if e.get("line")]
            invalid, lines = int(counts.get("invalid_lines", 0)), int(counts.get("lines", 0))
            raise BatchRefused(errors or detail, invalid, lines) from exc

    def get(self, batch_id: str) -> BatchView:
        """GET /v1/batches/{id}."""
        return self.client.get_batch(batch_id)

    def list(self, cursor: str | None, limit: int) -> BatchList:
        """GET /v1/batches."""
        return self.client.list_batches(cursor=cursor, limit=limit)

    def cancel(self, batch_id: str) -> BatchView:
        """POST /v1/batches/{id}/cancel."""
        return self.client.cancel_batch(batch_id)

    def results(self, batch_id: str) -> Iterator[bytes]:
        """GET /v1/batches/{id}/results, streamed."""
        return self.client.batch_results_raw(batch_id)

    def pause(self, batch_id: str) -> BatchView:
        """POST /v1/batches/{id}/pause."""
        return self.client.pause_batch(batch_id)

    def resume(self, batch_id: str) -> BatchView:
        """POST /v1/batches/{id}/resume."""
        return self.client.resume_batch(batch_id)

    def retry(self, batch_id: str, include: Iterable[str]) -> BatchView:
        """POST /v1/batches/{id}/retry?include=..."""
        return self.client.retry_batch(batch_id, include)

    def events(self, batch_id: str) -> Iterator[BatchView] | None:
        """GET /v1/batches/{id}/events (SSE)."""
        return self.client.batch_events(batch_id)

    def resolve(self, batch_id: str) -> str:
        """The batch a full id or unique prefix names: GET /v1/batches?id_prefix=... if need be."""
        return resolve_id("batch", batch_id, self._exists, self._starting_with)

    def _exists(self, batch_id: str) -> bool:
        from kiln.tasks.client.client import JobNotFoundError  # the client's 404

        try:
            self.client.get_batch(batch_id)
        except JobNotFoundError:
            return False
        return True  # or another key's (403): the command itself says so

    def _starting_with(self, prefix: str, limit: int) -> Sequence[str]:
        from kiln.tasks.client.client import ValidationFailed

        try:
            page = self.client.list_batches(id_prefix=prefix, limit=limit)
        except ValidationFailed:  # an API from before `id_prefix`: full ids only
            return []
        return [view.id for view in page.batches]

    def close(self) -> None:
        """Close the HTTP connections."""
        self.client.close()


def backend_for(api: str | None, api_key: str | None) -> BatchBackend:
    """The remote API when `api` is given, else Redis and the object store directly."""
    if api:
        return HttpBatches(api, api_key)
    return DirectBatches()


def _file_chunks(path: Path, size: int = 256 * 1024) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(size):
            yield chunk
