"""`kiln batch submit FILE.jsonl [--wait]` and following a batch until it ends.

A batch is followed through its event stream (GET /v1/batches/{id}/events) where the backend has
one, read in a thread so that `--timeout` holds even while no event comes; where there is none,
or the stream is missing or breaks, the batch is polled instead.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.common.states import BatchStatus, is_final_batch
from kiln.tasks.cli.batch_backends import BatchBackend, BatchRefused, SubmitOptions
from kiln.tasks.cli.batch_display import BatchProgress, show_batch
from kiln.tasks.cli.exits import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    UsageError,
    say_stopped_waiting,
)
from kiln.tasks.contract.batches import BatchView

ERRORS_SHOWN = 20
POLL_S = 1.0
STREAM_ENDED = None


class BatchWaitTimeout(Exception):
    """`--timeout` ran out; `view` is the last one seen."""

    def __init__(self, view: BatchView) -> None:
        super().__init__(f"batch {view.id} still {view.status}")
        self.view = view


def submit_options(args: argparse.Namespace) -> SubmitOptions:
    """The options of `kiln batch submit` from its arguments."""
    return SubmitOptions(
        pipeline=args.pipeline,
        priority=str(args.priority),
        completion_window=args.completion_window,
        skip_invalid=args.skip_invalid,
        metadata=_metadata(args.metadata),
    )


def _metadata(pairs: list[str]) -> dict[str, str]:
    metadata = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--metadata {pair!r}: expected KEY=VALUE")
        metadata[key] = value
    return metadata


def submit(args: argparse.Namespace, backend: BatchBackend) -> int:
    """Submit the file; print its id (or view), or follow it to the end with `--wait`."""
    try:
        view = backend.submit(Path(args.file), submit_options(args))
    except BatchRefused as exc:
        for line in refusal_lines(exc):
            print(f"kiln: {line}", file=sys.stderr)
        print(f"kiln: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not args.wait:
        if args.json:
            show_batch(True, view)
        else:
            print(view.id)
        return 0
    return wait_and_show(args, backend, view)


def refusal_lines(refused: BatchRefused) -> list[str]:
    """What a refused file's errors say, one line each; one mistake on many lines said once.

    `line 3, column 51: expecting ',' delimiter`; `every line, pipeline: unknown pipeline ...`
    when the same error is on every line (a batch-wide option such as --pipeline), else
    `lines 2, 5, 9, ...`.
    """
    by_mistake: dict[tuple[str, str], list[int]] = {}
    said: list[str] = []
    for error in refused.errors:
        number = int(error.get("line") or 0)
        if not number:  # the file as a whole
            if error.get("type") not in _SAID_BY_THE_COUNTS:
                said.append(str(error.get("msg")))
            continue
        by_mistake.setdefault((_where(error.get("loc", [])[3:]), _reason(error)), []).append(number)
    everywhere = refused.invalid == refused.lines and len(by_mistake) == 1
    for (where, reason), numbers in list(by_mistake.items())[:ERRORS_SHOWN]:
        if everywhere and len(numbers) > 1:
            lines = "every line"
        else:
            shown = ", ".join(str(n) for n in numbers[:ERRORS_SHOWN])
            lines = f"line{'s' if len(numbers) > 1 else ''} {shown}"
        said.append(f"{lines}{', ' + where if where else ''}: {reason}")
    return said


# file-wide errors the closing "batch refused: N of M lines are invalid" already says
_SAID_BY_THE_COUNTS = ("batch_invalid", "batch_no_valid_lines")


def _where(loc: list[Any]) -> str:
    """Where in the line: a column (a JSON error's character offset) or the field's path."""
    if len(loc) == 1 and isinstance(loc[0], int):
        return f"column {loc[0] + 1}"
    return ".".join(str(part) for part in loc)


def _reason(error: dict[str, Any]) -> str:
    msg = str(error.get("msg", ""))
    # "Expecting ',' delimiter" reads as part of the line: lower-case, but not "JSON ..."
    return msg[:1].lower() + msg[1:] if msg[1:2].islower() else msg


def wait_and_show(args: argparse.Namespace, backend: BatchBackend, view: BatchView) -> int:
    """Follow the batch with progress; show its final view; exit 0 if every accepted line succeeded.

    Lines skipped as invalid on request (`--skip-invalid`) are not failures: they are reported
    (the view's `invalid` count, a line on stderr). Ctrl-C leaves the batch running (130).
    """
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        with BatchProgress.for_terminal(args.json) as progress:
            view = follow(backend, view, progress, deadline)
    except BatchWaitTimeout as exc:
        print(f"kiln: {exc} after {args.timeout:g} s", file=sys.stderr)
        return EXIT_WAIT_TIMEOUT
    except KeyboardInterrupt:
        say_stopped_waiting(args, f"batch {view.id} goes on", f"kiln batch wait {view.id}")
        return EXIT_INTERRUPTED
    show_batch(args.json, view)
    if view.error:
        print(f"kiln: batch {view.id} {view.status}: {view.error}", file=sys.stderr)
    if view.counts.invalid and is_final_batch(view.status):
        print(
            f"kiln: batch {view.id}: {view.counts.invalid} invalid line(s) skipped, not run "
            f"(kiln batch results {view.id} names them)",
            file=sys.stderr,
        )
    return 0 if every_accepted_line_succeeded(view) else EXIT_JOB_FAILED


def every_accepted_line_succeeded(view: BatchView) -> bool:
    """Whether the batch completed and every line it accepted (all but the invalid) succeeded."""
    counts = view.counts
    accepted = counts.total - counts.invalid
    return view.status == BatchStatus.completed and accepted > 0 and counts.succeeded == accepted


def follow(
    backend: BatchBackend, view: BatchView, progress: BatchProgress, deadline: float | None
) -> BatchView:
    """Show the batch's views until it ends (events where there are, else polling)."""
    progress.show(view)
    if is_final_batch(view.status):
        return view
    stream = backend.events(view.id)
    if stream is not None:
        view = _follow_events(stream, view, progress, deadline)
    while not is_final_batch(view.status):
        _check_deadline(view, deadline)
        time.sleep(_until(deadline, POLL_S))
        view = backend.get(view.id)
        progress.show(view)
    return view


def _follow_events(
    stream: Iterator[BatchView], view: BatchView, progress: BatchProgress, deadline: float | None
) -> BatchView:
    """Views from the stream until the final one; the last view seen if the stream gives up."""
    views: queue.Queue[BatchView | None] = queue.Queue()
    threading.Thread(target=_pump, args=(stream, views), daemon=True).start()
    while not is_final_batch(view.status):
        _check_deadline(view, deadline)
        try:
            got = views.get(timeout=_until(deadline, 60.0))
        except queue.Empty:
            continue
        if got is STREAM_ENDED:
            return view  # no stream (an older API), or it broke: polling takes over
        view = got
        progress.show(view)
    return view


def _pump(stream: Iterator[BatchView], views: queue.Queue[BatchView | None]) -> None:
    # Any failure of the stream only means "poll instead" (an API without the endpoint answers
    # 404, a broken connection ends it): the API's real errors reach the user through the
    # polling `get`, which raises them in the main thread.
    try:
        for view in stream:
            views.put(view)
    except Exception:  # see above
        pass
    finally:
        views.put(STREAM_ENDED)


def _check_deadline(view: BatchView, deadline: float | None) -> None:
    if deadline is not None and time.monotonic() >= deadline:
        raise BatchWaitTimeout(view)


def _until(deadline: float | None, most: float) -> float:
    if deadline is None:
        return most
    return max(0.0, min(most, deadline - time.monotonic()))
