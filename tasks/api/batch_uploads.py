"""`POST /v1/batches` with a JSON body: the batch file is an upload (`POST /v1/uploads`).

The body (`contract.batches.BatchFromUpload`, at most `UPLOAD_BODY_MAX` bytes, strict JSON) names
the caller's own upload and carries the batch's options; the upload must exist, be of a batch
content type and within `KILN_MAX_BATCH_BYTES` (`storage.uploaded_inputs.checked_upload`). The
file is then streamed from the store through the same line checks as a streamed body, and answered
the same way (201 with the view, or the 422 of a refused file).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import anyio.to_thread
from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from kiln.common.tracing import Carrier
from kiln.storage.uploaded_inputs import UploadRefused, checked_upload, resolve_upload
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.batch_options import BatchParams, batch_options
from kiln.tasks.api.body_limit import too_large_detail
from kiln.tasks.api.deps import field_error
from kiln.tasks.api.errors import BATCH_REFUSED_422, safe_json_response
from kiln.tasks.api.json_guard import body_errors
from kiln.tasks.batches.service import BatchService, refusal_body
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import BatchFromUpload
from kiln.tasks.contract.upload_slots import CONTENT_TYPES
from kiln.tasks.intake.refusal import Refused

# a JSON body names an upload and options: small, so read whole, and refused past this
UPLOAD_BODY_MAX = 64 * 1024
UPLOAD_BODY_SCHEMA = BatchFromUpload.model_json_schema()
# the options a JSON body carries itself: in the query as well they would be ambiguous
_OPTIONS = frozenset(BatchFromUpload.model_fields) - {"input_upload"}


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
