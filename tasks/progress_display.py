"""Rich progress bars for jobs being waited on (CLI `submit --wait`, `wait`, the demo)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from tasks.backends import JobsBackend
from tasks.schemas import JobView

TERMINAL = {"succeeded", "failed", "canceled", "expired"}


class JobWaitTimeout(TimeoutError):
    """A job did not finish within the wait's timeout."""


def _describe(view: JobView) -> tuple[str, int, int]:
    stage = view.progress.stage if view.progress else view.status
    step = (view.progress.step or 0) if view.progress else 0
    total = (view.progress.total or 0) if view.progress else 0
    label = view.status if view.status in TERMINAL or view.status == "queued" else stage
    return label, step, total


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
    columns = (
        TextColumn("{task.fields[job]}"),
        TextColumn("{task.fields[stage]:<10}"),
        BarColumn(),
        TextColumn("{task.completed:>3.0f}/{task.total:<3.0f}"),
        TimeElapsedColumn(),
    )
    views: dict[str, JobView] = {}
    with Progress(*columns, console=console, disable=not show, transient=False) as bars:
        tasks: dict[str, TaskID] = {
            job_id: bars.add_task("", total=1, job=job_id[:12], stage="queued")
            for job_id in job_ids
        }
        while True:
            if check is not None:
                check()
            for job_id in job_ids:
                if job_id in views and views[job_id].status in TERMINAL:
                    continue
                view = views[job_id] = backend.get(job_id)
                label, step, total = _describe(view)
                done = view.status == "succeeded"
                bars.update(
                    tasks[job_id],
                    stage=label,
                    completed=total if done else step,
                    total=max(total, 1),
                )
            if all(views[j].status in TERMINAL for j in job_ids):
                return [views[j] for j in job_ids]
            if deadline is not None and time.monotonic() > deadline:
                raise JobWaitTimeout(f"jobs not finished after {timeout_s}s")
            time.sleep(poll_s)
