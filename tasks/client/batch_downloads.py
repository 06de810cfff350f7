"""Downloading outputs: a batch's into `DIR/<custom_id>/<file>`, a job's into `DIR/<job>-<n>.<ext>`.

Each file is fetched through the URL its result line or job view carries (presigned when it was
read; `file://` for a local store; the API's `/v1/jobs/{id}/outputs/{n}`, sent with the key, for
`kiln get --api`), written to a temporary name, checked against the recorded sha256 and only
then renamed into place. A file already present with the right sha256 is kept,
so an interrupted download resumes where it stopped. A bounded pool of threads fetches files
concurrently over one shared connection pool.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx

from kiln.tasks.contract.batches import BatchResult
from kiln.tasks.contract.views import JobView

DEFAULT_DOWNLOAD_WORKERS = 8
CHUNK = 256 * 1024


@dataclass(frozen=True)
class OutputFile:
    """One output to download: where from, where to, and the sha256 it must have.

    `read`, when given, yields the bytes instead of the URL (a store read directly: `kiln get`
    without an API); it raises OSError when it cannot.
    """

    url: str
    path: Path
    sha256: str
    read: Callable[[], Iterable[bytes]] | None = None


@dataclass
class DownloadReport:
    """What a download did: files fetched, kept (already right), and those that failed."""

    downloaded: int = 0
    kept: int = 0
    failed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every output is now present with its sha256."""
        return not self.failed


class ChecksumMismatch(Exception):
    """A fetched file's sha256 is not the one its result line names."""


def output_files(results: Iterable[BatchResult], folder: Path) -> list[OutputFile]:
    """The files of every succeeded line: `folder/<custom_id or job_id>/<name of the key>`."""
    files = []
    for result in results:
        owner = result.custom_id or result.job_id or f"line-{result.line}"
        for output in result.outputs:
            name = output.key.rsplit("/", 1)[-1]
            files.append(OutputFile(output.url, folder / owner / name, output.sha256))
    return files


def job_output_files(
    view: JobView,
    folder: Path,
    url_of: Callable[[int, str], str] | None = None,
    read_of: Callable[[int], Callable[[], Iterable[bytes]]] | None = None,
) -> list[OutputFile]:
    """The files of a job's outputs: `folder/<job id>-<n>.<ext>`.

    Output n is fetched from `url_of(n, url)` (default: the URL its view carries), or read by
    `read_of(n)` when that is given.
    """
    files = []
    for index, output in enumerate(view.outputs):
        ext = output.key.rsplit(".", 1)[-1] if "." in output.key.rsplit("/", 1)[-1] else "bin"
        url = output.url if url_of is None else url_of(index, output.url)
        read = None if read_of is None else read_of(index)
        files.append(OutputFile(url, folder / f"{view.id}-{index}.{ext}", output.sha256, read))
    return files


def file_sha256(path: Path) -> str | None:
    """The sha256 of a file, or None when it does not exist."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch(http: httpx.Client, item: OutputFile, into: Path) -> str:
    """Write the output's bytes (its `read`, else its URL's body) to `into`; their sha256."""
    digest = hashlib.sha256()
    url = item.url
    with into.open("wb") as out:
        if item.read is not None:
            for chunk in item.read():
                digest.update(chunk)
                out.write(chunk)
            return digest.hexdigest()
        if url.startswith("file://"):
            with open(unquote(urlparse(url).path), "rb") as source:
                while chunk := source.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
            return digest.hexdigest()
        with http.stream("GET", url) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    return digest.hexdigest()


def download_one(http: httpx.Client, item: OutputFile) -> bool:
    """Fetch one output unless present with its sha256; returns whether it was fetched."""
    if file_sha256(item.path) == item.sha256:
        return False
    item.path.parent.mkdir(parents=True, exist_ok=True)
    partial = item.path.with_name(f".{item.path.name}.part")
    try:
        got = _fetch(http, item, partial)
        if got != item.sha256:
            raise ChecksumMismatch(f"{item.path}: sha256 {got} is not {item.sha256}")
        os.replace(partial, item.path)  # only a verified file takes the final name
    finally:
        partial.unlink(missing_ok=True)
    return True


def download_outputs(
    files: list[OutputFile],
    *,
    workers: int = DEFAULT_DOWNLOAD_WORKERS,
    on_done: Callable[[OutputFile, bool], None] | None = None,
    headers: dict[str, str] | None = None,
) -> DownloadReport:
    """Download `files` with a pool of `workers` threads; every file is verified by sha256.

    `headers` go with every request: an API key, only where every URL is the API's own.
    """
    report = DownloadReport()
    limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
    with httpx.Client(limits=limits, timeout=60.0, headers=headers) as http:

        def one(item: OutputFile) -> tuple[OutputFile, bool | Exception]:
            try:
                return item, download_one(http, item)
            except (httpx.HTTPError, OSError, ChecksumMismatch) as exc:
                return item, exc

        with ThreadPoolExecutor(max_workers=workers) as pool:
            for item, outcome in pool.map(one, files):
                if isinstance(outcome, Exception):
                    report.failed.append(f"{item.path}: {outcome}")
                    continue
                if outcome:
                    report.downloaded += 1
                else:
                    report.kept += 1
                if on_done is not None:
                    on_done(item, outcome)
    return report
