"""How `kiln batch` shows batches: a table, a list, and live progress while one runs.

Progress goes to stderr (stdout keeps the batch's JSON or table): a rich progress bar on a
terminal, one plain line per change otherwise, nothing with `--json`.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn
from rich.table import Table

from kiln.common.states import is_final_batch
from kiln.tasks.cli.consoles import stdout_console
from kiln.tasks.cli.exits import print_json
from kiln.tasks.cli.tables import fitting_table, whole_width
from kiln.tasks.contract.batches import BatchCounts, BatchList, BatchView


def done_count(counts: BatchCounts) -> int:
    """Lines that ended, one way or another."""
    return counts.succeeded + counts.failed + counts.canceled + counts.expired + counts.invalid


def not_ok_count(counts: BatchCounts) -> int:
    """Lines that ended without succeeding."""
    return counts.failed + counts.canceled + counts.expired + counts.invalid


def _rate(view: BatchView) -> str:
    return f"{view.throughput_per_s:.1f}/s" if view.throughput_per_s else "-/s"


def _eta(view: BatchView) -> str:
    return f"ETA {view.eta_s:.0f}s" if view.eta_s is not None else "ETA -"


def progress_line(view: BatchView) -> str:
    """One line of progress: done / total, rate, ETA, failures."""
    c = view.counts
    line = (
        f"batch {view.id} {view.status}: {done_count(c)}/{c.total} done, {_rate(view)}, "
        f"{_eta(view)}, {not_ok_count(c)} not ok"
    )
    return f"{line}: {view.error}" if view.error else line


class BatchProgress:
    """Shows a batch's views as they come: a rich bar (`live`), plain lines, or nothing."""

    def __init__(self, mode: str, stream: TextIO | None = None) -> None:
        self.mode = mode  # "live", "plain" or "quiet"
        self.stream = stream or sys.stderr
        self.last_line = ""
        self.bars: Progress | None = None
        self.task: TaskID | None = None
        if mode == "live":
            self.bars = Progress(
                TextColumn("batch {task.fields[batch]} {task.fields[status]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} {task.fields[eta]} {task.fields[not_ok]} not ok"),
                console=Console(file=self.stream),
            )

    @classmethod
    def for_terminal(cls, json_output: bool) -> BatchProgress:
        """Quiet for `--json`, a live bar on a terminal, plain lines otherwise."""
        if json_output:
            return cls("quiet")
        return cls("live" if sys.stderr.isatty() else "plain")

    def __enter__(self) -> BatchProgress:
        if self.bars is not None:
            self.bars.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.bars is not None:
            self.bars.stop()

    def show(self, view: BatchView) -> None:
        """Draw one view (a plain line only when it says something new)."""
        if self.mode == "plain":
            line = progress_line(view)
            if line != self.last_line:
                print(line, file=self.stream, flush=True)
                self.last_line = line
        elif self.bars is not None:
            self._draw(self.bars, view)

    def _draw(self, bars: Progress, view: BatchView) -> None:
        fields: dict[str, Any] = {
            "batch": view.id,
            "status": view.status,
            "rate": _rate(view),
            "eta": _eta(view),
            "not_ok": not_ok_count(view.counts),
        }
        if self.task is None:
            self.task = bars.add_task("", total=view.counts.total, **fields)
        bars.update(self.task, completed=done_count(view.counts), **fields)


def show_batch(json_output: bool, view: BatchView) -> None:
    """A batch on stdout: JSON or a table."""
    if json_output:
        print_json(view.model_dump(mode="json"))
        return
    stdout_console().print(batch_table(view))


def show_batch_list(json_output: bool, page: BatchList) -> None:
    """A page of batches on stdout: JSON or a table."""
    if json_output:
        print_json(page.model_dump(mode="json"))
        return
    # whole ids and states, never cut to fit the terminal: every command takes what this prints
    table = fitting_table(
        "batch", "status", "outcome", "done", "created", whole=("batch", "status")
    )
    rows = [
        (
            view.id,
            str(view.status),
            view.outcome or "",
            f"{done_count(view.counts)}/{view.counts.total}",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(view.created_at)),
        )
        for view in page.batches
    ]
    for column in (0, 1):
        whole_width(table, column, [row[column] for row in rows])
    for row in rows:
        table.add_row(*row)
    stdout_console().print(table)
    if page.next_cursor:
        print(f"more: --cursor {page.next_cursor}")


def batch_table(view: BatchView) -> Table:
    """A human view of one batch."""
    title = f"batch {view.id}"
    table = Table(title=title, show_header=False, min_width=len(title))  # the id never wraps
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # wrapped when narrow, never cut short
    table.add_row("status", view.status + (f" ({view.outcome})" if view.outcome else ""))
    if view.error:
        table.add_row("error", view.error)
    if view.parent_id:
        table.add_row("retry of", view.parent_id)
    for name, value in view.counts.model_dump().items():
        table.add_row(name, str(value))
    if view.throughput_per_s:
        table.add_row("throughput", f"{view.throughput_per_s:.2f} lines/s")
    if view.eta_s is not None and not is_final_batch(view.status):
        table.add_row("ETA", f"{view.eta_s:.0f} s")
    table.add_row("results written", str(view.results_written))
    return table
