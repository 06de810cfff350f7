"""`POST /v1/uploads` (a presigned PUT for an input), the local store's PUT, and image checks.

A job's image input names an upload (`upload:<id>`) or a URL (`contract.image_refs`). At submit
the intake (`tasks.intake`) checks what it can before a node spends time on it: the upload is the
caller's own and within the limits, the URL passes the SSRF guard with the input allow-list. The
node checks both again when it reads or fetches the image.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool

from kiln.common.media import UPLOAD_ID, UPLOAD_REF_PREFIX
from kiln.storage.object_base import ObjectStore
from kiln.storage.object_streams import ObjectWriter, open_writer
from kiln.storage.uploaded_inputs import (
    IssuedSlot,
    UploadSlots,
    new_upload_id,
    presigned_slot,
    upload_key,
)
from kiln.tasks.api.context import ApiContext
from kiln.tasks.api.deps import Caller, Ctx, api_router, error_docs, field_error
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.contract.upload_slots import (
    CONTENT_TYPES,
    LOCAL_PUT_PATH,
    UPLOADS_PATH,
    UploadRequest,
    UploadSlotView,
)

router = api_router()
# pieces of a PUT body handed to the writer's thread at once: few thread hops, bounded memory
WRITE_BYTES = 1024 * 1024
UploadId = Annotated[str, Query(min_length=32, max_length=32, pattern=f"^{UPLOAD_ID.pattern}$")]


def upload_limit(settings: KilnSettings, purpose: str) -> int:
    """The largest upload of a purpose: an image, or a batch file."""
    return settings.max_batch_bytes if purpose == "batch" else settings.upload_max_bytes


def _objects(ctx: ApiContext) -> ObjectStore:
    if ctx.objects is None:
        raise HTTPException(503, "no object store is configured; uploads are unavailable")
    return ctx.objects


@router.post(
    UPLOADS_PATH,
    status_code=201,
    response_model=UploadSlotView,
    responses=error_docs(401, 503),
    tags=["uploads"],
)
def create_upload(
    ctx: Ctx, caller: Caller, body: UploadRequest, request: Request
) -> UploadSlotView:
    """A slot for one input: PUT the bytes to `url` with `headers`, then name it by `ref`."""
    allowed = CONTENT_TYPES[body.purpose]
    if body.content_type.lower() not in allowed:
        msg = f"{body.purpose} uploads are one of {', '.join(sorted(allowed))}"
        raise field_error(("body", "content_type"), msg, "content_type", body.content_type)
    limit = upload_limit(ctx.settings, body.purpose)
    if body.bytes > limit:
        msg = f"{body.purpose} uploads are at most {limit} bytes"
        raise field_error(("body", "bytes"), msg, "less_than_equal", body.bytes, le=limit)
    objects = _objects(ctx)
    upload_id = new_upload_id()
    key = upload_key(getattr(objects, "prefix", ""), caller.key_id, upload_id)
    local_url = str(request.url_for("put_local_upload").include_query_params(upload_id=upload_id))
    content_type = body.content_type.lower()
    expires_s = ctx.settings.upload_expiry_s
    slot = presigned_slot(
        objects,
        key,
        content_type=content_type,
        size=body.bytes,
        expires_s=expires_s,
        local_url=local_url,
    )
    # what the API's own PUT (a local store) checks a body against, until the slot expires
    _slots(ctx).issue(caller.key_id, upload_id, IssuedSlot(body.bytes, content_type), expires_s)
    return UploadSlotView(
        upload_id=slot.upload_id,
        ref=f"{UPLOAD_REF_PREFIX}{slot.upload_id}",
        key=slot.key,
        url=slot.url,
        headers=slot.headers,
        expires_at=slot.expires_at,
    )


@router.put(
    LOCAL_PUT_PATH,
    status_code=204,
    responses=error_docs(401, 404, 413, 503),
    tags=["uploads"],
    name="put_local_upload",
)
async def put_local_upload(ctx: Ctx, caller: Caller, request: Request, upload_id: UploadId) -> None:
    """The PUT of a slot on a local (file://) store: the caller's key stands in for a signature.

    Only a slot this API issued to the caller and not yet expired takes a body (else 404), of
    the content type it declared, and at most the size it declared (else 413, nothing stored).
    The body streams to the store in chunks; a short one is refused too (422), as S3 would.
    """
    objects = _objects(ctx)
    slot = await run_in_threadpool(_slots(ctx).issued, caller.key_id, upload_id)
    if slot is None:
        detail = f"no upload slot {upload_id!r} for this API key (never issued, or expired)"
        raise HTTPException(404, detail)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    allowed = CONTENT_TYPES["image"] | CONTENT_TYPES["batch"]
    if content_type not in allowed:
        msg = f"Content-Type must be one of {', '.join(sorted(allowed))}"
        raise field_error(("header", "content-type"), msg, "content_type", content_type)
    if content_type != slot.content_type:
        msg = f"Content-Type must be {slot.content_type}, as the upload slot declared"
        raise field_error(("header", "content-type"), msg, "content_type", content_type)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > slot.size:
        raise _over_slot(slot)  # refused before a byte is read
    key = upload_key(getattr(objects, "prefix", ""), caller.key_id, upload_id)
    writer = await run_in_threadpool(open_writer, objects, key, content_type)
    size = await _stream_into(request, writer, slot.size)
    if size is None:
        raise _over_slot(slot)
    if size != slot.size:
        await run_in_threadpool(writer.abort)
        msg = f"the body is {size} bytes; the upload slot declared {slot.size}"
        raise field_error(("body",), msg, "upload_size", size, declared=slot.size)
    await run_in_threadpool(writer.commit)


def _slots(ctx: ApiContext) -> UploadSlots:
    return UploadSlots(ctx.store.redis, ctx.store.settings)


def _over_slot(slot: IssuedSlot) -> HTTPException:
    return HTTPException(
        413, f"request body is over the {slot.size} bytes its upload slot declared"
    )


async def _stream_into(request: Request, writer: ObjectWriter, max_bytes: int) -> int | None:
    """Write the body to `writer` in `WRITE_BYTES` pieces: its size, or None past `max_bytes`.

    Past `max_bytes` reading stops and what was written is dropped; one piece at most is held
    in memory.
    """
    size, pending = 0, bytearray()
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                await run_in_threadpool(writer.abort)
                return None
            pending += chunk
            if len(pending) >= WRITE_BYTES:
                data, pending = bytes(pending), bytearray()
                await run_in_threadpool(writer.write, data)
        await run_in_threadpool(writer.write, bytes(pending))
    except BaseException:  # a client gone mid-upload included: nothing is left under the key
        writer.abort()
        raise
    return size
