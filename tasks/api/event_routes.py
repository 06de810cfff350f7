"""The event stream route: a job's events as server-sent events (docs/contract.md §6)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import Header, HTTPException, Query
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kiln.tasks.api.deps import (
    Authorization,
    Caller,
    Ctx,
    JobId,
    api_router,
    json_error_docs,
    visible_job,
)
from kiln.tasks.api.sse import EventStream, StreamGuard

router = api_router()
# Event ids are Redis stream ids `<seq>-0`, and Redis takes at most 64 bits: above that the stream
# read fails after the 200 has gone out.
MAX_SEQ = 2**64 - 1


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` response; `on_close` runs when it ends, however it ends."""

    media_type = "text/event-stream"
    on_close: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream, then run `on_close` (end of stream, client gone, or an error)."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


def stream_guard(ctx: Ctx, caller: Caller, header: str | None) -> StreamGuard:
    """A slot for one more event stream of the caller, and what ends it; 429 past the caps."""
    stream = ctx.sse_slots.acquire(caller.key_id or "-")
    if stream is None:
        retry_after = str(ctx.settings.sse_busy_retry_after_s)
        raise HTTPException(
            429, "too many open event streams; retry later", headers={"Retry-After": retry_after}
        )
    return StreamGuard(stream, ctx.auth, header, ctx.sse_limiter)


def event_stream_response(frames: AsyncIterator[str], guard: StreamGuard) -> EventStreamResponse:
    """The SSE response of `frames`: unbuffered by proxies; the slot is released at its end."""
    response = EventStreamResponse(
        frames, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    response.on_close = guard.stream.release
    return response


EVENTS_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-sent events: `id` = seq, `event` = type, `data` = the event as "
        "JSON ({seq, type, time, payload}). Ends after the terminal event, or earlier (its "
        "lifetime, a fair share, a revoked key): resume with `Last-Event-ID`.",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **json_error_docs(401, 403, 404, 429),
}


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=EventStreamResponse,
    responses=EVENTS_DOC,
    tags=["jobs"],
)
def job_events(
    ctx: Ctx,
    caller: Caller,
    header: Authorization,
    job_id: JobId,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_SEQ, description="Resume after this seq.")
    ] = None,
    last_event_id: Annotated[
        int | None,
        Header(alias="Last-Event-ID", ge=0, le=MAX_SEQ, description="SSE resume (wins over after)"),
    ] = None,
) -> EventStreamResponse:
    """The job's events as server-sent events, from the start or after a seq."""
    visible_job(ctx, caller, job_id)
    start = last_event_id if last_event_id is not None else (after or 0)
    guard = stream_guard(ctx, caller, header)
    stream = EventStream(
        ctx.store,
        job_id,
        start,
        block_ms=ctx.settings.sse_block_ms,
        keepalive_s=ctx.settings.sse_keepalive_s,
        limiter=ctx.sse_limiter,
        guard=guard,
    )
    return event_stream_response(stream.frames(), guard)
