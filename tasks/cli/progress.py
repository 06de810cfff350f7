"""Rich progress bars for jobs being waited on (CLI `submit --wait`, `wait`, the demo)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from kiln.common.states import JobState, is_terminal
from kiln.tasks.cli.backends import JobsBackend
from kiln.tasks.contract.views import JobView


class JobWaitTimeout(TimeoutError):
    """A job did not finish within the wait's timeout."""


def _describe(view: JobView) -> tuple[str, int, int]:
    stage = view.progress.stage if view.progress else view.status
    step = (view.progress.step or 0) if view.progress else 0
    total = (view.progress.total or 0) if view.progress else 0
    label = view.status if is_terminal(view.status) or view.status == JobState.QUEUED else stage
    return label, step, total


def _bars(console: Console | None, show: bool) -> Progress:
    columns = (
        TextColumn("{task.fields[job]}"),
        TextColumn("{task.fields[stage]:<10}"),
        BarColumn(),
        TextColumn("{task.completed:>3.0f}/{task.total:<3.0f}"),
        TimeElapsedColumn(),
    )
    return Progress(*columns, console=console, disable=not show, transient=False)


def _bar(view: JobView) -> tuple[str, int, int]:
    """Where the job's bar stands: its stage, steps done, steps in all (a finished job: full)."""
    label, step, total = _describe(view)
    total = max(total, 1)
    return label, total if view.status == JobState.SUCCEEDED else step, total


def _new_bar(
    backend: JobsBackend, bars: Progress, job_id: str, views: dict[str, JobView]
) -> TaskID:
    """A bar for the job, first drawn from its current view (kept in `views`)."""
    view = views[job_id] = backend.get(job_id)
    stage, completed, total = _bar(view)
    return bars.add_task("", job=job_id, stage=stage, completed=completed, total=total)


def _poll(backend: JobsBackend, bars: Progress, task: TaskID, job_id: str) -> JobView:
    """Read one job's view and move its bar."""
    view = backend.get(job_id)
    stage, completed, total = _bar(view)
    bars.update(task, stage=stage, completed=completed, total=total)
    return view


def wait_for_jobs(
    backend: JobsBackend,
    job_ids: Sequence[str],
    *,
    timeout_s: float | None = None,
    show: bool = True,
    console: Console | None = None,
    poll_s: float = 0.2,
    check: Callable[[], None] | None = None,
) -> list[JobView]:
    """Poll until every job is terminal, drawing one bar per job; returns the final views.

    `check`, called once per poll, may raise to stop waiting (the demo: its worker died).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    views: dict[str, JobView] = {}
    with _bars(console, show) as bars:
        # each bar starts from the job's real state (a finished job never shows `queued 0/1`),
        # with its whole id, which every command takes
        tasks = {job_id: _new_bar(backend, bars, job_id, views) for job_id in job_ids}
        while True:
            if check is not None:
                check()
            for job_id in job_ids:
                if not is_terminal(views[job_id].status):
                    views[job_id] = _poll(backend, bars, tasks[job_id], job_id)
            if all(is_terminal(views[j].status) for j in job_ids):
                return [views[j] for j in job_ids]
            if deadline is not None and time.monotonic() > deadline:
                raise JobWaitTimeout(f"jobs not finished after {timeout_s}s")
            time.sleep(poll_s)
