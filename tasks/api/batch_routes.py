"""The batch routes of the HTTP API: submit a JSONL file, read, list, stream results.

Steering a batch (cancel, pause, resume, retry) is `batch_control_routes`; its events (SSE)
`batch_event_routes`.

`POST /v1/batches` reads its body as a stream: each chunk is validated and written on to the
object store in a worker thread (`batches.intake`), so neither the file nor its validation ever
sits whole in memory or on the event loop. The body limit is `KILN_MAX_BATCH_BYTES` (the app's
`BodySizeLimit` lets this path through unbuffered) and the body deadline
`KILN_BATCH_BODY_TIMEOUT_S` (`api.http_guard`).

What applies to the whole batch arrives as query parameters (a JSONL body) or as fields of a JSON
body naming an upload (`POST /v1/uploads`); `batch_options` checks them the same way either way,
and a refusal is a 422 naming the parameter where it was given (`["query", <name>]` or
`["body", <name>]`). The JSON body (`contract.batches.BatchFromUpload`, at most `UPLOAD_BODY_MAX`
bytes, strict JSON) names the caller's own upload, which must exist, be of a batch content type
and within `KILN_MAX_BATCH_BYTES` (`storage.uploaded_inputs.checked_upload`); the file is then
streamed from the store through the same line checks as a streamed body, and answered the same
way (201 with the view, or the 422 of a refused file).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kiln.common.defaults import BATCH_LANE
from kiln.common.media import BATCH_INPUT_CONTENT_TYPE
from kiln.common.request import Lane
from kiln.common.tracing import (
    BATCH_ID_ATTRIBUTE,
    BATCH_ITEMS_ATTRIBUTE,
    BATCH_SPAN,
    TRACEPARENT,
    TRACESTATE,
    Carrier,
    SpanKind,
    given_carrier,
    job_carrier,
    set_span_attributes,
    span,
)
from kiln.storage.uploaded_inputs import UploadRefused, checked_upload, resolve_upload
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.batch_deps import BATCH_ERRORS, Batches, BatchId, visible_batch
from kiln.tasks.api.body_limit import too_large_detail
from kiln.tasks.api.deps import (
    Caller,
    Ctx,
    api_router,
    error_docs,
    field_error,
    json_error_docs,
    refuse_over_page_limit,
)
from kiln.tasks.api.errors import BATCH_REFUSED_422, safe_json_response
from kiln.tasks.api.json_guard import body_errors
from kiln.tasks.api.short_ids import IdPrefix, batches_with_prefix
from kiln.tasks.batches.intake import BatchIntake, IntakeReport, LineDefaults
from kiln.tasks.batches.results import RESULTS_CONTENT_TYPE
from kiln.tasks.batches.service import BatchOptions, BatchService, new_batch_id, refusal_body
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import (
    BATCHES_PATH,
    CUSTOM_ID_PATTERN,
    DEFAULT_COMPLETION_WINDOW,
    BatchFromUpload,
    BatchList,
    BatchView,
    parse_completion_window,
)
from kiln.tasks.contract.schemas import JobRequest, PipelineName, WebhookEvent, WebhookSpec
from kiln.tasks.contract.upload_slots import CONTENT_TYPES
from kiln.tasks.intake.refusal import Refused

router = api_router()
# chunks of the body handed to the intake thread at once: few thread hops, bounded memory
FEED_BYTES = 256 * 1024
# a JSON body names an upload and options: small, so read whole, and refused past this
UPLOAD_BODY_MAX = 64 * 1024
UPLOAD_BODY_SCHEMA = BatchFromUpload.model_json_schema()
# the options a JSON body carries itself: in the query as well they would be ambiguous
_OPTIONS = frozenset(BatchFromUpload.model_fields) - {"input_upload"}
# the body as OpenAPI describes it: JSONL, each line one object (a job request plus custom_id)
LINES_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["custom_id", "prompt"],
        "properties": {"custom_id": {"type": "string", "pattern": CUSTOM_ID_PATTERN}},
        "additionalProperties": True,
    },
}


@router.post(
    BATCHES_PATH,
    status_code=201,
    response_model=BatchView,
    responses={**error_docs(401, 413, 503)},
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "JSONL: one job request per line, each with a unique `custom_id`; or "
            "a JSON object naming an uploaded file (`input_upload`) with the batch's options.",
            "content": {
                BATCH_INPUT_CONTENT_TYPE: {"schema": LINES_SCHEMA},
                "application/json": {"schema": UPLOAD_BODY_SCHEMA},
            },
        }
    },
    tags=["batches"],
)
async def submit_batch(
    request: Request,
    caller: Caller,
    service: Batches,
    pipeline: Annotated[PipelineName | None, Query(description="Default pipeline.")] = None,
    priority: Annotated[Lane, Query(description="Default lane of the lines.")] = BATCH_LANE,
    completion_window: Annotated[
        str, Query(max_length=16, description="e.g. 24h, 90m, 2d: unstarted lines expire then.")
    ] = DEFAULT_COMPLETION_WINDOW,
    skip_invalid: Annotated[
        bool, Query(description="Run the valid lines; report invalid ones as results.")
    ] = False,
    metadata: Annotated[
        str | None, Query(max_length=16384, description="JSON object: default metadata.")
    ] = None,
    webhook_url: Annotated[str | None, Query(max_length=2048)] = None,
    webhook_events: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    """Accept a JSONL batch: validated line by line as it streams to the object store.

    With `Content-Type: application/json` the body instead names an upload and carries the
    options (`submit_upload`); the query then takes none.
    """
    params = BatchParams(
        pipeline, priority, completion_window, skip_invalid, metadata, webhook_url, webhook_events
    )
    # the batch's span: its line jobs' traces link to it (kiln/common/tracing.py)
    given = given_carrier(request.headers.get(TRACEPARENT), request.headers.get(TRACESTATE))
    with span(BATCH_SPAN, given, kind=SpanKind.SERVER) as batch_span:
        return await _submit_batch(request, caller, service, params, job_carrier(batch_span, given))


async def _submit_batch(
    request: Request, caller: Principal, service: BatchService, params: BatchParams, trace: Carrier
) -> Response:
    if is_json_body(request):
        return await submit_upload(request, caller, service, trace)
    options = await anyio.to_thread.run_sync(batch_options, service, caller, params)
    options = replace(options, trace=trace)
    batch_id = new_batch_id()
    intake = await anyio.to_thread.run_sync(service.new_intake, batch_id, options)
    limit = service.settings.max_batch_bytes
    try:
        report = await _take_body(request, intake, limit)
    except Refused as exc:  # no line's fault: a lookup the intake needs failed (object store)
        return JSONResponse({"detail": exc.refusal.message}, status_code=exc.refusal.status)
    if report is None:
        return JSONResponse({"detail": too_large_detail(limit)}, status_code=413)
    if report.refused:
        await anyio.to_thread.run_sync(intake.abort)
        return safe_json_response(refusal_body(report), 422, BATCH_REFUSED_422)
    batch = await anyio.to_thread.run_sync(service.accept, batch_id, report, options)
    set_span_attributes({BATCH_ID_ATTRIBUTE: batch.id, BATCH_ITEMS_ATTRIBUTE: batch.items})
    view = batch_view(batch)
    return JSONResponse(view.model_dump(mode="json"), status_code=201)


async def _take_body(request: Request, intake: BatchIntake, limit: int) -> IntakeReport | None:
    """Feed the body to `intake` in `FEED_BYTES` chunks; None (all dropped) past `limit` bytes.

    One chunk is validated in a worker thread while the next one is read: the thread need not
    wait for the client and the event loop between chunks (on a busy machine each hop is a wait
    for a core), and the body held stays two chunks.
    """
    size, pending = 0, bytearray()
    feeding: asyncio.Task[None] | None = None  # the chunk being validated, if any
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                await _settled(feeding)
                feeding = None
                await anyio.to_thread.run_sync(intake.abort)
                return None
            pending += chunk
            if len(pending) >= FEED_BYTES:
                await _settled(feeding)  # its error, if any, is this request's
                data, pending = bytes(pending), bytearray()
                feeding = asyncio.ensure_future(anyio.to_thread.run_sync(intake.feed, data))
        await _settled(feeding)
        feeding = None
        await anyio.to_thread.run_sync(intake.feed, bytes(pending))
        return await anyio.to_thread.run_sync(intake.finish)
    except BaseException:  # a client gone mid-upload included: drop what was written
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await _settled(feeding)  # the intake is not thread-safe: abort after its feed ends
        intake.abort()
        raise


async def _settled(feeding: asyncio.Task[None] | None) -> None:
    """Wait for the chunk in validation (its error raised); a cancel waits for it too."""
    if feeding is not None:
        with anyio.CancelScope(shield=True):  # as `to_thread.run_sync`: the thread runs on
            await feeding


# --- the batch's options: query parameters or a JSON body's fields -------------------------


@dataclass(frozen=True)
class BatchParams:
    """The batch options as given (not checked yet)."""

    pipeline: str | None = None
    priority: Lane = BATCH_LANE
    completion_window: str = DEFAULT_COMPLETION_WINDOW
    skip_invalid: bool = False
    metadata: str | None = None  # JSON text of an object
    webhook_url: str | None = None
    webhook_events: str | None = None  # comma-separated


def _metadata(text: str | None, max_depth: int, where: str) -> dict[str, str]:
    if text is None:
        return {}
    strict = body_errors(text.encode("utf-8", "surrogatepass"), max_depth)
    if strict:
        msg = f"metadata is not strict JSON: {strict[0]['msg']}"
        raise field_error((where, "metadata"), msg, strict[0]["type"], None)
    try:
        parsed = json.loads(text)
        checked = JobRequest.model_validate({"prompt": "-", "metadata": parsed}).metadata
    except (ValueError, ValidationError) as exc:
        msg = f"metadata must be a JSON object of strings within the job limits: {exc}"
        raise field_error((where, "metadata"), msg, "metadata", text) from exc
    return dict(checked)


def _webhook(url: str | None, events: str | None, where: str) -> dict[str, Any] | None:
    if url is None:
        if events is not None:
            raise field_error((where, "webhook_events"), "needs webhook_url", "missing", events)
        return None
    chosen = [e.strip() for e in events.split(",")] if events else [WebhookEvent.completed]
    try:
        spec = WebhookSpec.model_validate({"url": url, "events": chosen})
    except ValidationError as exc:
        raise field_error((where, "webhook_url"), str(exc), "webhook", url) from exc
    return spec.model_dump(mode="json")


def _check_webhook(service: BatchService, webhook: dict[str, Any] | None, where: str) -> None:
    """The batch's webhook against the intake's webhook rule (its lines inherit it)."""
    if webhook is None:
        return
    url = str(webhook["url"])
    refusal = service.intake.webhook_refusal(url, (where, "webhook_url"))
    if refusal is not None:
        raise field_error(refusal.loc, refusal.message, refusal.code, url)


def batch_options(
    service: BatchService, caller: Principal, params: BatchParams, where: str = "query"
) -> BatchOptions:
    """The checked options (422 naming the parameter); resolves the webhook's host: a thread."""
    webhook = _webhook(params.webhook_url, params.webhook_events, where)
    _check_webhook(service, webhook, where)
    try:
        window_s = parse_completion_window(params.completion_window)
    except ValueError as exc:
        loc = (where, "completion_window")
        raise field_error(loc, str(exc), "completion_window", params.completion_window) from exc
    defaults = LineDefaults(
        pipeline=params.pipeline,
        priority=str(params.priority),
        webhook=webhook,
        metadata=_metadata(params.metadata, service.settings.max_json_depth, where),
    )
    return BatchOptions(defaults, window_s, params.skip_invalid, caller.key_id)


# --- a JSON body naming an upload (`POST /v1/uploads`) as the batch's file ------------------


def is_json_body(request: Request) -> bool:
    """Whether the body is JSON (an upload named) rather than the JSONL file itself."""
    content_type = request.headers.get("content-type", "")
    return content_type.split(";")[0].strip().lower() == "application/json"


async def _read_small(request: Request) -> bytes | None:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > UPLOAD_BODY_MAX:
            return None
    return bytes(body)


def _parse(raw: bytes, max_depth: int) -> BatchFromUpload:
    strict = body_errors(raw, max_depth)
    if strict:
        raise RequestValidationError(strict)
    try:
        return BatchFromUpload.model_validate_json(raw)
    except ValidationError as exc:
        errors = [
            {"type": e["type"], "loc": ("body", *e["loc"]), "msg": e["msg"], "input": None}
            for e in exc.errors()
        ]
        raise RequestValidationError(errors) from exc


def _params(body: BatchFromUpload) -> BatchParams:
    events = ",".join(body.webhook_events) if body.webhook_events is not None else None
    metadata = json.dumps(body.metadata) if body.metadata is not None else None
    return BatchParams(
        body.pipeline,
        body.priority,
        body.completion_window,
        body.skip_invalid,
        metadata,
        body.webhook_url,
        events,
    )


def _upload_key(service: BatchService, caller: Principal, ref: str) -> str:
    """The caller's upload's object key, checked: a 422 at `input_upload` if it cannot be used."""
    limit = service.settings.max_batch_bytes
    try:
        key = resolve_upload(service.objects, caller.key_id, ref)
        checked_upload(service.objects, key, limit, CONTENT_TYPES["batch"])
    except UploadRefused as exc:
        raise field_error(("body", "input_upload"), str(exc), "upload", ref) from exc
    return key


async def submit_upload(
    request: Request, caller: Principal, service: BatchService, trace: Carrier | None = None
) -> Response:
    """Accept a batch whose file is an upload: the JSON body names it and gives the options.

    `trace`: the batch's W3C trace context (its span's), which its line jobs link to.
    """
    ambiguous = sorted(_OPTIONS & set(request.query_params))
    if ambiguous:
        msg = "with a JSON body the options go in the body, not the query"
        raise field_error(("query", ambiguous[0]), msg, "ambiguous_option", None)
    raw = await _read_small(request)
    if raw is None:
        return JSONResponse({"detail": too_large_detail(UPLOAD_BODY_MAX)}, status_code=413)
    body = _parse(raw, service.settings.max_json_depth)
    options = await anyio.to_thread.run_sync(batch_options, service, caller, _params(body), "body")
    options = replace(options, trace=dict(trace or {}))
    key = await anyio.to_thread.run_sync(_upload_key, service, caller, body.input_upload)
    try:
        batch, report = await anyio.to_thread.run_sync(service.submit_stored, key, options)
    except Refused as exc:  # no line's fault: a lookup the intake needs failed (object store)
        return JSONResponse({"detail": exc.refusal.message}, status_code=exc.refusal.status)
    if batch is None:
        return safe_json_response(refusal_body(report), 422, BATCH_REFUSED_422)
    view: dict[str, Any] = batch_view(batch).model_dump(mode="json")
    return JSONResponse(view, status_code=201)


# --- reading batches -----------------------------------------------------------------------


@router.get(
    BATCHES_PATH + "/{batch_id}", response_model=BatchView, responses=BATCH_ERRORS, tags=["batches"]
)
def get_batch(caller: Caller, service: Batches, batch_id: BatchId) -> BatchView:
    """A batch: status, counts, times, throughput and ETA."""
    return batch_view(visible_batch(service, caller, batch_id))


@router.get(BATCHES_PATH, response_model=BatchList, responses=error_docs(401), tags=["batches"])
def list_batches(
    ctx: Ctx,
    caller: Caller,
    service: Batches,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, description="At most KILN_LIST_LIMIT_MAX.")] = 50,
    id_prefix: IdPrefix = None,
) -> BatchList:
    """Batches newest first: the caller's own (an admin key: every one)."""
    refuse_over_page_limit(ctx, limit)
    owner = None if caller.admin else caller.key_id
    if not caller.admin and owner is None:
        return BatchList(batches=[])
    if id_prefix is not None:
        return batches_with_prefix(service, owner, id_prefix, limit)
    try:
        batches, next_cursor = service.list(owner, cursor, limit)
    except ValueError as exc:
        raise field_error(("query", "cursor"), f"invalid cursor: {exc}", "cursor", cursor) from exc
    return BatchList(batches=[batch_view(b) for b in batches], next_cursor=next_cursor)


@router.get(
    BATCHES_PATH + "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "JSONL: one line per finished input line; a finished batch ends with "
            "its summary line.",
            "content": {RESULTS_CONTENT_TYPE: {"schema": {"type": "string"}}},
        },
        **json_error_docs(401, 403, 404),
    },
    tags=["batches"],
)
def batch_results(caller: Caller, service: Batches, batch_id: BatchId) -> StreamingResponse:
    """Every result line written so far (output URLs presigned now), streamed."""
    visible_batch(service, caller, batch_id)
    lines: Iterator[bytes] = service.results(batch_id)
    return StreamingResponse(lines, media_type=RESULTS_CONTENT_TYPE)
