"""`kiln batch`: submit a JSONL file of jobs, follow it, control it, read its results.

`submit FILE.jsonl [--wait]`, `status BATCH`, `wait BATCH`, `list`,
`results BATCH [-o FILE] [--download DIR]`, `cancel|pause|resume BATCH`,
`retry BATCH [--include failed,expired,canceled]`; `--json` on each; BATCH may be any unique
prefix of the id (`cli.short_ids`). Without
`--api` they go straight to Redis and the object store (as `kiln submit` does; the file is
validated here, line by line, with the API's rules); with `--api URL --api-key KEY` through the
HTTP API. A refused file prints its first errors by line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kiln.common.defaults import BATCH_LANE
from kiln.common.request import Lane
from kiln.tasks.cli.backends import remote_args
from kiln.tasks.cli.batch_backends import BatchBackend, backend_for
from kiln.tasks.cli.batch_display import show_batch, show_batch_list
from kiln.tasks.cli.batch_results import results
from kiln.tasks.cli.batch_submit import submit, wait_and_show
from kiln.tasks.cli.exits import EXIT_JOB_FAILED, UsageError
from kiln.tasks.cli.short_ids import BATCH_ID_HELP
from kiln.tasks.contract.batches import DEFAULT_COMPLETION_WINDOW, RetryInclude

RETRY_INCLUDE = tuple(RetryInclude)
DOWNLOAD_WORKERS = 8  # the client's default (httpx loads only when a command needs it)
CONTROLS = {"status": "show a batch", "cancel": "cancel a batch", "pause": "pause a batch"}
CONTROLS["resume"] = "feed a paused batch again, its lines resumed"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote_args(parser)


def _waiting(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", action="store_true", help="show progress and wait for the end")
    _timeout(parser, "with --wait ")


def _timeout(parser: argparse.ArgumentParser, when: str = "") -> None:
    parser.add_argument(
        "--timeout", type=float, help=f"seconds to wait {when}(then exit 3; default: none)"
    )


def _batch_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("batch_id", metavar="BATCH", help=BATCH_ID_HELP)


def _add_submit(actions: Any) -> None:
    s = actions.add_parser("submit", help="submit FILE.jsonl (one job per line + custom_id)")
    s.add_argument("file", metavar="FILE.jsonl", help="one job request and custom_id per line")
    s.add_argument("--pipeline", help="pipeline of the lines that name none (default: default)")
    s.add_argument(
        "--priority",
        choices=list(Lane),
        default=BATCH_LANE,
        help="lane of the lines that name none",
    )
    s.add_argument(
        "--completion-window",
        default=DEFAULT_COMPLETION_WINDOW,
        help="e.g. 24h, 90m, 2d: lines not started by then expire",
    )
    s.add_argument("--skip-invalid", action="store_true", help="run the valid lines only")
    s.add_argument(
        "--metadata",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="the batch's metadata, repeatable (default: none)",
    )
    _waiting(s)
    _common(s)


def _add_results(actions: Any) -> None:
    r = actions.add_parser("results", help="a batch's result lines (JSONL) so far, and outputs")
    _batch_id(r)
    r.add_argument(
        "-o", "--output", metavar="FILE", help="write the lines to FILE (default: stdout)"
    )
    r.add_argument(
        "--download",
        metavar="DIR",
        help="fetch every output into DIR/<custom_id>/<file>, sha256-verified (resumable; "
        "default: no download)",
    )
    r.add_argument("--workers", type=int, default=DOWNLOAD_WORKERS, help="downloads at a time")
    _common(r)


def _add_retry(actions: Any) -> None:
    r = actions.add_parser("retry", help="a new batch of a finished batch's unsucceeded lines")
    _batch_id(r)
    r.add_argument(
        "--include",
        default=",".join(RETRY_INCLUDE),
        help="which ended lines to run again: failed, expired, canceled (default: all three)",
    )
    _waiting(r)
    _common(r)


def add_parser(sub: Any) -> None:
    """`kiln batch ...` and its actions."""
    batch = sub.add_parser("batch", help="batches: a JSONL file of jobs, fed as capacity frees up")
    actions = batch.add_subparsers(dest="batch_action", required=True)
    _add_submit(actions)
    for name, text in CONTROLS.items():
        p = actions.add_parser(name, help=text)
        _batch_id(p)
        _common(p)
    w = actions.add_parser("wait", help="follow a batch to its end, as submit --wait does")
    _batch_id(w)
    _timeout(w)
    _common(w)
    listed = actions.add_parser("list", help="list batches, newest first")
    listed.add_argument("--limit", type=int, default=20, help="batches per page")
    listed.add_argument(
        "--cursor", help="where the page starts: the last page's `more:` (default: newest)"
    )
    _common(listed)
    _add_results(actions)
    _add_retry(actions)


def run(args: argparse.Namespace) -> int:
    """Run one `kiln batch` action."""
    from kiln.storage.errors import BatchNotFound

    if args.batch_action == "submit" and not Path(args.file).is_file():
        raise UsageError(f"no such file: {args.file}")
    if args.batch_action == "results" and args.workers < 1:
        raise UsageError("--workers must be at least 1")
    backend = backend_for(args.api, args.api_key)
    try:
        return _run(args, backend)
    except BatchNotFound as exc:
        print(f"kiln: no such batch: {exc}", file=sys.stderr)
        return EXIT_JOB_FAILED
    finally:
        backend.close()


def _run(args: argparse.Namespace, backend: BatchBackend) -> int:
    action = args.batch_action
    if getattr(args, "batch_id", None) is not None:
        args.batch_id = backend.resolve(args.batch_id)
    if action == "submit":
        return submit(args, backend)
    if action == "results":
        return results(args, backend)
    if action == "list":
        show_batch_list(args.json, backend.list(args.cursor, args.limit))
        return 0
    if action == "wait":
        return wait_and_show(args, backend, backend.get(args.batch_id))
    if action == "retry":
        view = backend.retry(args.batch_id, _include(args.include))
        return wait_and_show(args, backend, view) if args.wait else _shown(args, view)
    controls = {
        "status": backend.get,
        "cancel": backend.cancel,
        "pause": backend.pause,
        "resume": backend.resume,
    }
    show_batch(args.json, controls[action](args.batch_id))
    return 0


def _shown(args: argparse.Namespace, view: Any) -> int:
    show_batch(args.json, view)
    return 0


def _include(text: str) -> list[str]:
    states = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [s for s in states if s not in RETRY_INCLUDE]
    if not states or unknown:
        subset = ",".join(RETRY_INCLUDE)
        raise UsageError(f"--include {text!r}: a comma-separated subset of {subset}")
    return states
