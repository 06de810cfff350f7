"""The batch routes of the HTTP API: submit a JSONL file, read, list, cancel, stream results.

`POST /v1/batches` reads its body as a stream: each chunk is validated and written on to the
object store in a worker thread (`batches.intake`), so neither the file nor its validation ever
sits whole in memory or on the event loop. The body limit is `KILN_MAX_BATCH_BYTES` (the app's
`BodySizeLimit` lets this path through unbuffered) and the body deadline
`KILN_BATCH_BODY_TIMEOUT_S` (`api.http_guard`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Depends, HTTPException, Path, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from kiln.storage.batch_store import FedBatch
from kiln.storage.errors import BatchNotFound
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.body_limit import too_large_detail
from kiln.tasks.api.deps import Caller, Ctx, api_router, error_docs, field_error, json_error_docs
from kiln.tasks.api.errors import safe_json_response
from kiln.tasks.api.json_guard import body_errors
from kiln.tasks.batches.intake import LineDefaults
from kiln.tasks.batches.service import BatchOptions, BatchService, new_batch_id, refusal_body
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import (
    BATCHES_PATH,
    CUSTOM_ID_PATTERN,
    DEFAULT_COMPLETION_WINDOW,
    BatchList,
    BatchView,
    parse_completion_window,
)
from kiln.tasks.contract.schemas import JobRequest, Lane, PipelineName, WebhookEvent, WebhookSpec
from kiln.tasks.webhooks.ssrf import UnsafeUrl, check_url

router = api_router()
# chunks of the body handed to the intake thread at once: few thread hops, bounded memory
FEED_BYTES = 256 * 1024
BatchId = Annotated[str, Path(max_length=128, description="A batch id.")]
BATCH_ERRORS = error_docs(401, 403, 404)
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
_REFUSED_422 = {"detail": [{"type": "batch_invalid", "loc": ["body"], "msg": "Invalid batch"}]}


def batch_service(request: Request) -> BatchService:
    """The app's batch service, built on first use from its context."""
    service: BatchService | None = getattr(request.app.state, "kiln_batches", None)
    if service is None:
        ctx = request.app.state.kiln
        depth = ctx.settings.max_json_depth
        if ctx.objects is None:
            raise HTTPException(503, "batches need an object store")
        service = BatchService(
            ctx.store,
            ctx.objects,
            ctx.submitter,
            ctx.settings,
            lambda raw: body_errors(raw, depth),
            policy=ctx.policy,
            resolve=ctx.resolve,
        )
        request.app.state.kiln_batches = service
    return service


Batches = Annotated[BatchService, Depends(batch_service)]


def _visible(service: BatchService, caller: Principal, batch_id: str) -> FedBatch:
    try:
        batch = service.get(batch_id)
    except BatchNotFound as exc:
        raise HTTPException(404, f"no batch {batch_id!r}") from exc
    if not caller.may_see(batch.owner):
        raise HTTPException(403, "this batch belongs to another API key")
    return batch


def _metadata(text: str | None, max_depth: int) -> dict[str, str]:
    if text is None:
        return {}
    strict = body_errors(text.encode("utf-8", "surrogatepass"), max_depth)
    if strict:
        msg = f"metadata is not strict JSON: {strict[0]['msg']}"
        raise field_error(("query", "metadata"), msg, strict[0]["type"], None)
    try:
        parsed = json.loads(text)
        checked = JobRequest.model_validate({"prompt": "-", "metadata": parsed}).metadata
    except (ValueError, ValidationError) as exc:
        msg = f"metadata must be a JSON object of strings within the job limits: {exc}"
        raise field_error(("query", "metadata"), msg, "metadata", text) from exc
    return dict(checked)


def _webhook(url: str | None, events: str | None) -> dict[str, Any] | None:
    if url is None:
        if events is not None:
            raise field_error(("query", "webhook_events"), "needs webhook_url", "missing", events)
        return None
    chosen = [e.strip() for e in events.split(",")] if events else [WebhookEvent.completed]
    try:
        spec = WebhookSpec.model_validate({"url": url, "events": chosen})
    except ValidationError as exc:
        raise field_error(("query", "webhook_url"), str(exc), "webhook", url) from exc
    return spec.model_dump(mode="json")


def _check_webhook(service: BatchService, webhook: dict[str, Any] | None) -> None:
    """The batch's webhook against the same rules as a job's (its lines inherit it)."""
    if webhook is None:
        return
    loc, url = ("query", "webhook_url"), str(webhook["url"])
    secret = service.settings.webhook_secret
    if secret is None or not secret.get_secret_value():
        msg = "webhooks are not configured on this server (no KILN_WEBHOOK_SECRET)"
        raise field_error(loc, msg, "webhooks_disabled", url)
    try:
        check_url(url, service.policy, service.resolve)
    except UnsafeUrl as exc:
        raise field_error(loc, f"refused: {exc}", "unsafe_url", url) from exc


def _options(
    service: BatchService,
    caller: Principal,
    pipeline: str | None,
    priority: Lane,
    completion_window: str,
    skip_invalid: bool,
    metadata: str | None,
    webhook: dict[str, Any] | None,
) -> BatchOptions:
    try:
        window_s = parse_completion_window(completion_window)
    except ValueError as exc:
        loc = ("query", "completion_window")
        raise field_error(loc, str(exc), "completion_window", completion_window) from exc
    defaults = LineDefaults(
        pipeline=pipeline,
        priority=str(priority),
        webhook=webhook,
        metadata=_metadata(metadata, service.settings.max_json_depth),
    )
    return BatchOptions(defaults, window_s, skip_invalid, caller.key_id)


@router.post(
    BATCHES_PATH,
    status_code=201,
    response_model=BatchView,
    responses={**error_docs(401, 413, 503)},
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "JSONL: one job request per line, each with a unique `custom_id`.",
            "content": {"application/x-ndjson": {"schema": LINES_SCHEMA}},
        }
    },
    tags=["batches"],
)
async def submit_batch(
    request: Request,
    caller: Caller,
    service: Batches,
    pipeline: Annotated[PipelineName | None, Query(description="Default pipeline.")] = None,
    priority: Annotated[Lane, Query(description="Default lane of the lines.")] = Lane.bulk,
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
    """Accept a JSONL batch: validated line by line as it streams to the object store."""
    webhook = _webhook(webhook_url, webhook_events)
    await anyio.to_thread.run_sync(_check_webhook, service, webhook)  # resolves the host
    options = _options(
        service, caller, pipeline, priority, completion_window, skip_invalid, metadata, webhook
    )
    batch_id = new_batch_id()
    intake = await anyio.to_thread.run_sync(service.new_intake, batch_id, options)
    limit = service.settings.max_batch_bytes
    size, pending = 0, bytearray()
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                await anyio.to_thread.run_sync(intake.abort)
                return JSONResponse({"detail": too_large_detail(limit)}, status_code=413)
            pending += chunk
            if len(pending) >= FEED_BYTES:
                data, pending = bytes(pending), bytearray()
                await anyio.to_thread.run_sync(intake.feed, data)
        await anyio.to_thread.run_sync(intake.feed, bytes(pending))
        report = await anyio.to_thread.run_sync(intake.finish)
    except BaseException:  # a client gone mid-upload included: drop what was written
        intake.abort()
        raise
    if report.refused:
        await anyio.to_thread.run_sync(intake.abort)
        return safe_json_response(refusal_body(report), 422, _REFUSED_422)
    batch = await anyio.to_thread.run_sync(service.accept, batch_id, report, options)
    view = batch_view(batch)
    return JSONResponse(view.model_dump(mode="json"), status_code=201)


@router.get(
    BATCHES_PATH + "/{batch_id}", response_model=BatchView, responses=BATCH_ERRORS, tags=["batches"]
)
def get_batch(caller: Caller, service: Batches, batch_id: BatchId) -> BatchView:
    """A batch: status, counts, times, throughput and ETA."""
    return batch_view(_visible(service, caller, batch_id))


@router.get(BATCHES_PATH, response_model=BatchList, responses=error_docs(401), tags=["batches"])
def list_batches(
    ctx: Ctx,
    caller: Caller,
    service: Batches,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> BatchList:
    """Batches newest first: the caller's own (an admin key: every one)."""
    owner = None if caller.admin else caller.key_id
    if not caller.admin and owner is None:
        return BatchList(batches=[])
    try:
        batches, next_cursor = service.list(owner, cursor, min(limit, ctx.settings.list_limit_max))
    except ValueError as exc:
        raise field_error(("query", "cursor"), f"invalid cursor: {exc}", "cursor", cursor) from exc
    return BatchList(batches=[batch_view(b) for b in batches], next_cursor=next_cursor)


@router.post(
    BATCHES_PATH + "/{batch_id}/cancel",
    response_model=BatchView,
    responses=BATCH_ERRORS,
    tags=["batches"],
)
def cancel_batch(caller: Caller, service: Batches, batch_id: BatchId) -> BatchView:
    """Stop feeding; queued jobs are canceled, running ones at their next step."""
    _visible(service, caller, batch_id)
    return batch_view(service.cancel(batch_id))


@router.get(
    BATCHES_PATH + "/{batch_id}/results",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "JSONL: one line per finished input line; a finished batch ends with "
            "its summary line.",
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
        },
        **json_error_docs(401, 403, 404),
    },
    tags=["batches"],
)
def batch_results(caller: Caller, service: Batches, batch_id: BatchId) -> StreamingResponse:
    """Every result line written so far (output URLs presigned now), streamed."""
    _visible(service, caller, batch_id)
    lines: Iterator[bytes] = service.results(batch_id)
    return StreamingResponse(lines, media_type="application/x-ndjson")
