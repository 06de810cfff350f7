"""`kiln batch results BATCH [-o FILE] [--download DIR]`: the result lines, and the outputs.

The lines stream to stdout or FILE as they are read. `--download DIR` also fetches every output
into `DIR/<custom_id>/<file>` through the URL its line carries, sha256-verified, a few at a time;
files already there with the right sha256 are kept, so running it again resumes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rich.console import Console
from rich.progress import Progress

from kiln.tasks.cli.batch_backends import BatchBackend
from kiln.tasks.cli.exits import EXIT_JOB_FAILED, print_json
from kiln.tasks.contract.batches import BatchResult

if TYPE_CHECKING:
    from kiln.tasks.client.batch_downloads import DownloadReport, OutputFile


def results(args: argparse.Namespace, backend: BatchBackend) -> int:
    """Write the result lines; with `--download`, fetch the outputs and report what happened."""
    lines = backend.results(args.batch_id)
    if args.download is None:
        with ExitStack() as stack:
            out = _sink(stack, args.output) or sys.stdout.buffer
            for line in lines:
                out.write(line)
            out.flush()
        return 0
    # Deferred: httpx loads only when outputs are downloaded.
    from kiln.tasks.client.batch_downloads import output_files

    found = _keep_results(lines, args.output)
    report = _download(output_files(found, Path(args.download)), args.workers, args.json)
    _show_report(args, report)
    return 0 if report.ok else EXIT_JOB_FAILED


def _sink(stack: ExitStack, output: str | None) -> BinaryIO | None:
    return stack.enter_context(open(output, "wb")) if output else None


def _keep_results(lines: Iterator[bytes], output: str | None) -> list[BatchResult]:
    """The result lines that name outputs (written to `output` on the way when given)."""
    from kiln.tasks.client.client import parse_batch_line

    found = []
    with ExitStack() as stack:
        out = _sink(stack, output)
        for raw in lines:
            if out is not None:
                out.write(raw)
            line = parse_batch_line(raw)
            if isinstance(line, BatchResult) and line.outputs:
                found.append(line)
    return found


def _download(files: list[OutputFile], workers: int, quiet: bool) -> DownloadReport:
    from kiln.tasks.client.batch_downloads import download_outputs

    show = not quiet and sys.stderr.isatty()
    with Progress(console=Console(stderr=True), disable=not show, transient=True) as bars:
        task = bars.add_task("downloading", total=len(files))
        return download_outputs(
            files, workers=workers, on_done=lambda _item, _fetched: bars.advance(task)
        )


def _show_report(args: argparse.Namespace, report: DownloadReport) -> None:
    if args.json:
        print_json(
            {
                "directory": args.download,
                "downloaded": report.downloaded,
                "kept": report.kept,
                "failed": report.failed,
            }
        )
        return
    print(
        f"{report.downloaded} downloaded, {report.kept} already present, "
        f"{len(report.failed)} failed, in {args.download}"
    )
    for failure in report.failed:
        print(f"kiln: {failure}", file=sys.stderr)
