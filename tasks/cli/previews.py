"""`kiln submit --preview DIR`: the newest preview of each job kept in DIR/<job_id>.<format>.

One thread per job follows its events (the API's SSE stream, or the Redis stream directly) and
replaces the file at each preview, atomically (a reader never sees half an image).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from kiln.common.states import is_terminal
from kiln.tasks.cli.backends import DirectBackend, HttpBackend, JobsBackend
from kiln.tasks.client.client import preview_image
from kiln.tasks.contract.events import preview_of
from kiln.tasks.contract.views import EventView, PreviewEvent, event_view

DIRECT_BLOCK_MS = 1000


def preview_path(folder: Path, job_id: str, preview_format: str) -> Path:
    """Where a job's newest preview is kept."""
    return folder / f"{job_id}.{preview_format}"


def write_preview(folder: Path, job_id: str, event: EventView) -> Path | None:
    """Replace the job's preview file with this event's image; its path, or None if gone."""
    data = preview_of(event)
    image = event.image if isinstance(event, PreviewEvent) else preview_image(data)
    if not image:
        return None
    path = preview_path(folder, job_id, data.format)
    partial = path.with_name(path.name + ".part")
    partial.write_bytes(image)
    os.replace(partial, path)
    return path


def job_events(backend: JobsBackend, job_id: str) -> Iterator[EventView]:
    """A job's events until its terminal one, from the API or from Redis."""
    if isinstance(backend, HttpBackend):
        yield from backend.client.events(job_id)
        return
    assert isinstance(backend, DirectBackend)
    after = 0
    while True:
        for stored in backend.store.events(job_id, after_seq=after, block_ms=DIRECT_BLOCK_MS):
            after = stored.seq
            yield event_view(stored)
            if is_terminal(stored.type):
                return


def follow_previews(
    backend: JobsBackend,
    job_ids: list[str],
    folder: Path,
    on_write: Callable[[str, Path, int], None] | None = None,
) -> list[threading.Thread]:
    """Start one daemon thread per job keeping its preview file; `on_write(job, path, step)`."""
    folder.mkdir(parents=True, exist_ok=True)

    def follow(job_id: str) -> None:
        for event in job_events(backend, job_id):
            if event.type != "preview":
                continue
            path = write_preview(folder, job_id, event)
            if path is not None and on_write is not None:
                on_write(job_id, path, int(event.payload.get("step", 0)))

    threads = [
        threading.Thread(target=follow, args=(job_id,), name=f"kiln-preview-{job_id}", daemon=True)
        for job_id in job_ids
    ]
    for thread in threads:
        thread.start()
    return threads
