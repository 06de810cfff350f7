"""`kiln batch`: submit a JSONL file of jobs, follow it, read its results, cancel it.

`submit FILE.jsonl [--wait]`, `status BATCH`, `list`, `results BATCH [-o FILE]`, `cancel BATCH`.
Without `--api` they go straight to Redis and the object store (as `kiln submit` does; the file
is validated here, line by line, with the API's rules); with `--api URL --api-key KEY` through
the HTTP API. A refused file prints its first errors by line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from rich.console import Console
from rich.table import Table

from kiln.tasks.cli.exits import (
    EXIT_JOB_FAILED,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    UsageError,
    print_json,
)
from kiln.tasks.contract.batches import (
    DEFAULT_COMPLETION_WINDOW,
    BatchList,
    BatchView,
    is_final_batch,
)
from kiln.tasks.contract.schemas import Lane

ACTIONS = ("submit", "status", "list", "results", "cancel")
ERRORS_SHOWN = 20
POLL_S = 1.0


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

    def close(self) -> None:
        """Release connections."""
        ...


class DirectBatches:
    """Batches straight in Redis and the object store (the same settings as the workers)."""

    def __init__(self) -> None:
        # Deferred: Redis, boto3, Celery and the API's JSON checks load only here.
        from kiln.storage.objects import open_object_store
        from kiln.storage.settings import StorageSettings
        from kiln.storage.status import JobStore
        from kiln.tasks.api.json_guard import body_errors
        from kiln.tasks.batches.service import BatchService
        from kiln.tasks.contract.settings import KilnSettings
        from kiln.tasks.queue.submit import Submitter

        settings, storage_settings = KilnSettings(), StorageSettings()
        store = JobStore.from_settings(storage_settings)
        depth = settings.max_json_depth
        self.service = BatchService(
            store,
            open_object_store(storage_settings),
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

    def close(self) -> None:
        """Close the HTTP connections."""
        self.client.close()


def _file_chunks(path: Path, size: int = 256 * 1024) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(size):
            yield chunk


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--api", metavar="URL", help="use a remote Kiln API instead of Redis")
    parser.add_argument("--api-key", metavar="KEY", help="bearer key for --api")


def add_parser(sub: Any) -> None:
    """`kiln batch ...` and its actions."""
    batch = sub.add_parser("batch", help="batches: a JSONL file of jobs, fed as capacity frees up")
    actions = batch.add_subparsers(dest="batch_action", required=True)
    s = actions.add_parser("submit", help="submit FILE.jsonl (one job per line + custom_id)")
    s.add_argument("file", metavar="FILE.jsonl")
    s.add_argument("--pipeline", help="default pipeline of the lines")
    s.add_argument("--priority", choices=list(Lane), default=Lane.bulk, help="default lane")
    s.add_argument(
        "--completion-window",
        default=DEFAULT_COMPLETION_WINDOW,
        help="e.g. 24h, 90m, 2d: lines not started by then expire",
    )
    s.add_argument("--skip-invalid", action="store_true", help="run the valid lines only")
    s.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE", help="repeatable"
    )
    s.add_argument("--wait", action="store_true", help="show progress and wait for the end")
    s.add_argument("--timeout", type=float, help="seconds to wait with --wait (then exit 3)")
    _common(s)
    for name, text in (("status", "show a batch"), ("cancel", "cancel a batch")):
        p = actions.add_parser(name, help=text)
        p.add_argument("batch_id", metavar="BATCH")
        _common(p)
    listed = actions.add_parser("list", help="list batches, newest first")
    listed.add_argument("--limit", type=int, default=20)
    listed.add_argument("--cursor")
    _common(listed)
    r = actions.add_parser("results", help="print a batch's result lines (JSONL) so far")
    r.add_argument("batch_id", metavar="BATCH")
    r.add_argument("-o", "--output", metavar="FILE", help="write them to FILE instead")
    _common(r)


def backend_for(args: argparse.Namespace) -> BatchBackend:
    """The remote API when `--api` is given, else Redis and the object store directly."""
    if getattr(args, "api", None):
        return HttpBatches(args.api, args.api_key)
    return DirectBatches()


def run(args: argparse.Namespace) -> int:
    """Run one `kiln batch` action."""
    from kiln.storage.errors import BatchNotFound

    try:
        return _run(args)
    except BatchNotFound as exc:
        print(f"kiln: no such batch: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED


def _run(args: argparse.Namespace) -> int:
    action = args.batch_action
    if action == "submit":
        _check_file(args.file)
    backend = backend_for(args)
    try:
        if action == "submit":
            return _submit(args, backend)
        if action == "status":
            _show(args, backend.get(args.batch_id))
        elif action == "cancel":
            _show(args, backend.cancel(args.batch_id))
        elif action == "list":
            _show_list(args, backend.list(args.cursor, args.limit))
        else:
            _write_results(backend.results(args.batch_id), args.output)
        return 0
    finally:
        backend.close()


def _check_file(name: str) -> None:
    if not Path(name).is_file():
        raise UsageError(f"no such file: {name}")


def _metadata(pairs: list[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--metadata {pair!r}: expected KEY=VALUE")
        metadata[key] = value
    return metadata


def _submit(args: argparse.Namespace, backend: BatchBackend) -> int:
    path = Path(args.file)
    options = SubmitOptions(
        pipeline=args.pipeline,
        priority=str(args.priority),
        completion_window=args.completion_window,
        skip_invalid=args.skip_invalid,
        metadata=_metadata(args.metadata),
    )
    try:
        view = backend.submit(path, options)
    except BatchRefused as exc:
        for error in exc.errors[:ERRORS_SHOWN]:
            where = ".".join(str(p) for p in error.get("loc", [])[3:]) or "line"
            print(f"kiln: line {error.get('line')}: {where}: {error.get('msg')}", file=sys.stderr)
        print(f"kiln: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.wait:
        if args.json:
            print_json(view.model_dump(mode="json"))
        else:
            print(view.id)
        return 0
    return _wait(args, backend, view)


def _wait(args: argparse.Namespace, backend: BatchBackend, view: BatchView) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    live = not args.json and sys.stderr.isatty()
    while not is_final_batch(view.status):
        if deadline is not None and time.monotonic() >= deadline:
            if live:
                print(file=sys.stderr)
            print(
                f"kiln: batch {view.id} still {view.status} after {args.timeout:g} s",
                file=sys.stderr,
            )
            return EXIT_WAIT_TIMEOUT
        if live:
            print("\r" + progress_line(view), end="", file=sys.stderr, flush=True)
        time.sleep(POLL_S)
        view = backend.get(view.id)
    if live:
        print("\r" + progress_line(view), file=sys.stderr)
    _show(args, view)
    return 0 if view.outcome == "succeeded" else EXIT_JOB_FAILED


def progress_line(view: BatchView) -> str:
    """One line of progress: done / total, rate, ETA, failures."""
    c = view.counts
    done = c.succeeded + c.failed + c.canceled + c.expired + c.invalid
    rate = f"{view.throughput_per_s:.1f}/s" if view.throughput_per_s else "-/s"
    eta = f"ETA {view.eta_s:.0f}s" if view.eta_s is not None else "ETA -"
    failed = c.failed + c.canceled + c.expired + c.invalid
    return (
        f"batch {view.id[:12]} {view.status}: {done}/{c.total} done, {rate}, {eta}, {failed} not ok"
    )


def _show(args: argparse.Namespace, view: BatchView) -> None:
    if args.json:
        print_json(view.model_dump(mode="json"))
        return
    Console().print(batch_table(view))


def _show_list(args: argparse.Namespace, page: BatchList) -> None:
    if args.json:
        print_json(page.model_dump(mode="json"))
        return
    table = Table(show_header=True)
    for column in ("batch", "status", "outcome", "done", "total", "created"):
        table.add_column(column)
    for view in page.batches:
        c = view.counts
        done = c.succeeded + c.failed + c.canceled + c.expired + c.invalid
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view.created_at))
        table.add_row(view.id, view.status, view.outcome or "", str(done), str(c.total), created)
    Console().print(table)
    if page.next_cursor:
        print(f"more: --cursor {page.next_cursor}")


def batch_table(view: BatchView) -> Table:
    """A human view of one batch."""
    table = Table(title=f"batch {view.id}", show_header=False)
    table.add_row("status", view.status + (f" ({view.outcome})" if view.outcome else ""))
    for name, value in view.counts.model_dump().items():
        table.add_row(name, str(value))
    if view.throughput_per_s:
        table.add_row("throughput", f"{view.throughput_per_s:.2f} lines/s")
    if view.eta_s is not None and not is_final_batch(view.status):
        table.add_row("ETA", f"{view.eta_s:.0f} s")
    table.add_row("results written", str(view.results_written))
    return table


def _write_results(lines: Iterator[bytes], output: str | None) -> None:
    if output is None:
        _copy(lines, sys.stdout.buffer)
        return
    with open(output, "wb") as handle:
        _copy(lines, handle)


def _copy(lines: Iterator[bytes], out: BinaryIO) -> None:
    for line in lines:
        out.write(line)
    out.flush()
