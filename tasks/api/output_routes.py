"""`GET /v1/jobs/{id}/outputs/{n}`: a job's output, streamed to the key that owns the job.

The bytes come from the store the output's record names (a local folder or S3), through the
API, so a browser page or a client that holds only an API key can open them: no presigned URL,
no `file://` path. One byte range per request (`Range: bytes=…`, what video players send) is a
206; a range the object cannot satisfy, or several ranges at once, is a 416 naming why.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Header, HTTPException, Path, Request, Response
from fastapi.responses import StreamingResponse

from kiln.storage.errors import ObjectNotFound, ObjectStoreError, ObjectStoreUnavailable
from kiln.storage.job_store import JobRecord
from kiln.storage.objects import ObjectStore, read_stream, store_named
from kiln.tasks.api.deps import Caller, Ctx, JobId, api_router, json_error_docs, visible_job
from kiln.tasks.contract.views import OUTPUT_STORAGE_URL

router = api_router()
OUTPUT_PATH = "/v1/jobs/{job_id}/outputs/{n}"
OutputIndex = Annotated[
    int, Path(ge=0, description="0-based index into the job's `outputs` (GET /v1/jobs/{id}).")
]
_RANGE = re.compile(r"(\d*)-(\d*)")
_RETRY_AFTER_S = 5  # an object store that answers "not now"


@dataclass(frozen=True)
class ByteRange:
    """Bytes `start` up to `stop` (exclusive) of an object of `size` bytes."""

    start: int
    stop: int
    size: int

    @property
    def content_range(self) -> str:
        """The `Content-Range` header of a 206 for this range."""
        return f"bytes {self.start}-{self.stop - 1}/{self.size}"


class RangeRefused(ValueError):
    """A `Range` header this route does not serve (416), with the reason."""


def parse_range(header: str, size: int) -> ByteRange:
    """The one byte range `header` asks of an object of `size` bytes; RangeRefused otherwise.

    `bytes=START-END` (END clamped to the object), `bytes=START-`, `bytes=-SUFFIX`.
    """
    unit, equals, spec = header.strip().partition("=")
    if not equals or unit.strip().lower() != "bytes":
        raise RangeRefused(f"only byte ranges are served (bytes=START-END); got {header!r}")
    if "," in spec:
        raise RangeRefused("one range per request; this route does not serve several at once")
    match = _RANGE.fullmatch(spec.strip())
    if match is None or match.group(1) == match.group(2) == "":
        raise RangeRefused(f"a range is bytes=START-END, START- or -SUFFIX; got {header!r}")
    first, last = match.group(1), match.group(2)
    try:
        if first == "":  # the last SUFFIX bytes
            suffix = int(last)
            if suffix == 0 or size == 0:
                raise RangeRefused(f"bytes=-{suffix} of a {size}-byte output is empty")
            return ByteRange(max(0, size - suffix), size, size)
        start = int(first)
        stop = size if last == "" else min(int(last) + 1, size)
    except ValueError as exc:  # digits beyond what an int parses from text
        if isinstance(exc, RangeRefused):
            raise
        raise RangeRefused(f"a range's numbers are too long: {header!r}") from exc
    if last != "" and int(last) < start:
        raise RangeRefused(f"a range ends before it starts: {header!r}")
    if start >= size:
        raise RangeRefused(f"the output has {size} bytes; the range starts at byte {start}")
    return ByteRange(start, stop, size)


def _output_entry(record: JobRecord, index: int) -> dict[str, Any]:
    """Entry `index` of the job's outputs; 404 naming how many there are."""
    outputs = record.outputs
    if index < len(outputs):
        return dict(outputs[index])
    if not outputs:
        raise HTTPException(404, f"job {record.id} has no outputs (status {record.state})")
    raise HTTPException(
        404, f"job {record.id} has {len(outputs)} output(s), 0 to {len(outputs) - 1}; no {index}"
    )


def _store_for(ctx: Ctx, entry: dict[str, Any]) -> ObjectStore:
    """The store the output was written to, or a 502/503 saying why it cannot be read."""
    written_to = entry.get(OUTPUT_STORAGE_URL)
    if ctx.objects is None:
        raise HTTPException(503, "this API has no object store configured")
    try:
        return store_named(ctx.objects, written_to if isinstance(written_to, str) else None)
    except (ObjectStoreError, ValueError) as exc:
        raise HTTPException(502, str(exc)) from exc


def _store_failure(exc: ObjectStoreError, record: JobRecord, index: int) -> HTTPException:
    """What a store's refusal means to the caller: gone (404), not now (503), broken (502)."""
    if isinstance(exc, (ObjectNotFound, ValueError)):  # InvalidObjectKey too
        return HTTPException(404, f"output {index} of job {record.id} is no longer stored")
    if isinstance(exc, ObjectStoreUnavailable):
        return HTTPException(503, str(exc), headers={"Retry-After": str(_RETRY_AFTER_S)})
    return HTTPException(502, f"the object store failed: {exc}")


def _filename(record: JobRecord, index: int, key: str) -> str:
    """`{job id}-{n}.{ext}`: what a download is saved as (the key's extension is checked)."""
    ext = key.rsplit(".", 1)[-1] if "." in key.rsplit("/", 1)[-1] else "bin"
    return f"{record.id}-{index}.{ext}"


@router.head(OUTPUT_PATH, include_in_schema=False)  # what GET answers, without the bytes
@router.get(
    OUTPUT_PATH,
    response_class=Response,
    responses={
        200: {"description": "The output's bytes.", "content": {"application/octet-stream": {}}},
        206: {"description": "One byte range of the output (`Range`)."},
        304: {"description": "Unchanged since the `If-None-Match` ETag."},
        **json_error_docs(401, 403, 404, 416, 502, 503),
    },
    tags=["jobs"],
)
def job_output(
    ctx: Ctx,
    caller: Caller,
    request: Request,
    job_id: JobId,
    n: OutputIndex,
    range_header: Annotated[str | None, Header(alias="Range", max_length=256)] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match", max_length=256)] = None,
    if_range: Annotated[str | None, Header(alias="If-Range", max_length=256)] = None,
) -> Response:
    """Output `n` of the job: its bytes and content type; one byte range on `Range`."""
    record = visible_job(ctx, caller, job_id)
    entry = _output_entry(record, n)
    key = str(entry["key"])
    store = _store_for(ctx, entry)
    try:
        stored = store.head(key)
    except ObjectStoreError as exc:
        raise _store_failure(exc, record, n) from exc
    if stored is None:
        raise _store_failure(ObjectNotFound(key), record, n)
    digest = str(entry.get("sha256") or stored.sha256)
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'inline; filename="{_filename(record, n, key)}"',
        "Cache-Control": "private, no-cache",  # revalidated by its ETag; never in a shared cache
    }
    if digest:
        headers["ETag"] = f'"{digest}"'
        if if_none_match is not None and _matches(if_none_match, headers["ETag"]):
            return Response(status_code=304, headers=headers)
    media_type = str(entry.get("content_type") or stored.content_type)
    size = stored.size
    wanted = range_header if _range_applies(if_range, headers.get("ETag")) else None
    try:
        span = parse_range(wanted, size) if wanted is not None else ByteRange(0, size, size)
    except RangeRefused as exc:
        refused = {"Content-Range": f"bytes */{size}"}
        raise HTTPException(416, str(exc), headers=refused) from exc
    status = 206 if wanted is not None else 200
    if status == 206:
        headers["Content-Range"] = span.content_range
    headers["Content-Length"] = str(span.stop - span.start)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type=media_type)
    try:
        chunks = read_stream(store, key, span.start, span.stop)
    except ObjectStoreError as exc:
        raise _store_failure(exc, record, n) from exc
    return StreamingResponse(
        _closing(chunks), status_code=status, headers=headers, media_type=media_type
    )


def _matches(if_none_match: str, etag: str) -> bool:
    """Whether `If-None-Match` names `etag` (or `*`); weak tags compare by value (RFC 9110)."""
    tags = {tag.strip().removeprefix("W/") for tag in if_none_match.split(",")}
    return "*" in tags or etag in tags


def _range_applies(if_range: str | None, etag: str | None) -> bool:
    """Whether `Range` is honoured: no `If-Range`, or one naming the current ETag."""
    return if_range is None or (etag is not None and if_range.strip() == etag)


def _closing(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """The chunks, with the store's handle closed however the response ends."""
    try:
        yield from chunks
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
