"""`kiln jobs` (a filtered listing, newest first) and `kiln get JOB [DIR]` (a job's outputs).

Both go where the other job commands go (`cli.backends`): Redis and the store directly, or the
API with `--api`. The listing reads pages of the store's indexes (`GET /v1/jobs`), filtered by
state and batch there and by pipeline and age here, until `--limit` jobs are found. `get` fetches
each output (through the API: `GET /v1/jobs/{id}/outputs/{n}`; else from the store its record
names) to `DIR/<job id>-<n>.<ext>`, verified against the sha256 the job's record names.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kiln.common.states import JobState
from kiln.tasks.cli.backends import JobsBackend
from kiln.tasks.cli.consoles import stdout_console
from kiln.tasks.cli.exits import EXIT_JOB_FAILED, UsageError, print_json
from kiln.tasks.cli.tables import age_text, fitting_table
from kiln.tasks.contract.views import JobView

MAX_PAGES = 100  # one `kiln jobs` reads at most this many pages, then prints `more: --cursor`
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def add_parsers(sub: Any, job_args: Any) -> None:
    """`kiln jobs` and `kiln get`; `job_args` adds `--json` and `--api`/`--api-key`."""
    from kiln.tasks.cli.short_ids import JOB_ID_HELP

    listed = sub.add_parser("jobs", help="list jobs, newest first, with filters")
    listed.add_argument(
        "--status",
        choices=[str(state) for state in JobState],
        help="only jobs in this state (default: any)",
    )
    listed.add_argument("--pipeline", help="only jobs of this pipeline (default: any)")
    listed.add_argument(
        "--batch", metavar="BATCH", help="only the jobs of this batch (its id or a unique prefix)"
    )
    listed.add_argument(
        "--since",
        metavar="WHEN",
        help="only jobs created since WHEN: an age such as 90m, 2h or 1d, or a date and time "
        "such as 2026-12-06T10:00 (default: any age)",
    )
    listed.add_argument("--limit", type=int, default=20, help="most jobs to list")
    listed.add_argument(
        "--cursor", help="where the listing starts: the last one's `more:` (default: newest)"
    )
    job_args(listed)
    get = sub.add_parser("get", help="fetch a job's outputs into DIR, sha256-verified")
    get.add_argument("job_id", metavar="JOB", help=JOB_ID_HELP)
    get.add_argument(
        "dir",
        metavar="DIR",
        nargs="?",
        default=".",
        help="where the files go, as <job id>-<n>.<ext>",
    )
    job_args(get)


@dataclass(frozen=True)
class JobFilter:
    """What `kiln jobs` lists: state and batch (filtered by the index), pipeline and age."""

    status: str | None = None
    pipeline: str | None = None
    batch_id: str | None = None
    since: float | None = None  # epoch seconds
    limit: int = 20

    def keeps(self, view: JobView) -> bool:
        """Whether a job the index gave passes the filters it cannot apply itself."""
        return self.pipeline is None or view.parameters.pipeline == self.pipeline


def parse_since(text: str, now: float | None = None) -> float:
    """Epoch seconds of `--since`: an age (`90m`, `2h`, `1d`, `30s`) or an ISO date and time."""
    now = time.time() if now is None else now
    match = _AGO.fullmatch(text.strip())
    if match is not None:
        return now - float(match[1]) * _UNIT_S[match[2]]
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise UsageError(
            f"--since {text!r}: an age such as 90m, 2h or 1d, or a date such as 2026-12-06T10:00"
        ) from None


def list_jobs(
    backend: JobsBackend, wanted: JobFilter, cursor: str | None = None
) -> tuple[list[JobView], str | None]:
    """Up to `wanted.limit` jobs that pass every filter, newest first, and the next cursor.

    Each page asks for no more than the jobs still wanted, so the cursor returned starts exactly
    after the last job listed. Pages stop at the first job older than `since`.
    """
    found: list[JobView] = []
    for _ in range(MAX_PAGES):
        views, cursor = backend.page(
            wanted.status, wanted.batch_id, cursor, wanted.limit - len(found)
        )
        for view in views:
            if wanted.since is not None and view.created_at < wanted.since:
                return found, None  # newest first: every later job is older still
            if wanted.keeps(view):
                found.append(view)
        if cursor is None or len(found) >= wanted.limit:
            break
    return found, cursor


def cmd_jobs(args: argparse.Namespace, backend: JobsBackend) -> int:
    """`kiln jobs`: a table (or `--json`) of the jobs that pass the filters."""
    if args.limit < 1:
        raise UsageError("--limit must be at least 1")
    wanted = JobFilter(
        status=args.status,
        pipeline=args.pipeline,
        batch_id=args.batch,
        since=None if args.since is None else parse_since(args.since),
        limit=args.limit,
    )
    views, cursor = list_jobs(backend, wanted, args.cursor)
    if args.json:
        print_json({"jobs": [v.model_dump(mode="json") for v in views], "next_cursor": cursor})
        return 0
    if not views:
        print("no jobs")
    else:
        console = stdout_console()
        console.print(jobs_table(views, console.width))
    if cursor is not None:
        print(f"more: --cursor {cursor}")
    return 0


def jobs_table(views: list[JobView], width: int) -> Any:
    """Jobs as rows, `width` columns wide: the prompt cut to what is left, a long pipeline wrapped.

    Ids, states, progress and ages are never cut nor wrapped.
    """
    columns = ("job", "status", "pipeline", "progress", "age", "prompt")
    whole = ("job", "status", "progress", "age")
    table = fitting_table(*columns, whole=whole)
    now = time.time()
    rows = [
        [
            view.id,
            str(view.status),
            view.parameters.pipeline,
            _done(view),
            age_text(now - view.created_at),
            view.parameters.prompt,
        ]
        for view in views
    ]
    widths = [max(len(name), *(len(row[n]) for row in rows)) for n, name in enumerate(columns)]
    # two spaces between columns; the prompt gets the rest of the line, at least its header's width
    room = max(len("prompt"), width - sum(widths[:-1]) - 2 * (len(columns) - 1))
    for row in rows:
        if len(row[-1]) > room:
            row[-1] = row[-1][: room - 1] + "…"
    for column, name in enumerate(columns):
        # a whole column as wide as its longest value (rich squeezes the others first); the
        # others squeezed, but never to a letter a line
        table.columns[column].min_width = (
            widths[column] if name in whole else min(widths[column], 8)
        )
    for row in rows:
        table.add_row(*row)
    return table


def _done(view: JobView) -> str:
    if view.outputs:
        return f"{len(view.outputs)} output{'s' if len(view.outputs) > 1 else ''}"
    if view.progress is not None and view.progress.total:
        return f"{view.progress.step or 0}/{view.progress.total}"
    return ""


def cmd_get(args: argparse.Namespace, backend: JobsBackend) -> int:
    """`kiln get JOB [DIR]`: exit 1 when the job has no outputs or a file failed its check."""
    view = backend.get(backend.resolve(args.job_id))
    folder = Path(args.dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{args.dir} is not a folder")
    if not view.outputs:
        print(f"kiln: job {view.id} is {view.status}: it has no outputs to get", file=sys.stderr)
        return EXIT_JOB_FAILED
    from kiln.tasks.client.batch_downloads import job_output_files

    report = backend.download(view, folder)
    names = [str(item.path) for item in job_output_files(view, folder)]
    failed = {line.split(": ", 1)[0] for line in report.failed}
    if args.json:
        print_json(
            {
                "job_id": view.id,
                "files": [name for name in names if name not in failed],
                "downloaded": report.downloaded,
                "kept": report.kept,
                "failed": report.failed,
            }
        )
    else:
        for name in names:
            if name not in failed:
                print(name)
    for failure in report.failed:
        print(f"kiln: {failure}", file=sys.stderr)
    return 0 if report.ok else EXIT_JOB_FAILED
