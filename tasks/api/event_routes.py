"""The event stream route: a job's events as server-sent events (docs/contract.md §6).

`EventStream` reads the job's Redis stream after a seq (a blocking read in a worker thread, under
the API's limiter) and sends each event as one frame (`format_event`): resumable by seq, it ends
after the terminal event. Its slot and what ends it early are `sse`'s (`StreamGuard`).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import anyio
import anyio.to_thread
from fastapi import Header, HTTPException, Query
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from kiln.common.states import is_terminal
from kiln.storage.job_store import JobEvent, JobStore
from kiln.tasks.api.deps import (
    Authorization,
    Caller,
    Ctx,
    JobId,
    api_router,
    json_error_docs,
    visible_job,
)
from kiln.tasks.api.sse import StreamGuard, closing_frame
from kiln.tasks.contract.events import event_json, parse_event

log = logging.getLogger(__name__)
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


def format_event(event: JobEvent) -> str:
    """One SSE frame: `id` is the event's seq, so `Last-Event-ID` resumes right after it.

    The data is the event parsed with the contract's union (tasks/contract/events.py) and given
    back as written. An entry the union refuses still goes out as stored, with a warning: a
    client's seqs never skip one.
    """
    try:
        wire = event_json(parse_event(event))
    except ValidationError as exc:
        log.warning("event %d of job stream is no known event, sent as stored: %s", event.seq, exc)
        wire = {"seq": event.seq, "type": event.type, "time": event.time, "payload": event.payload}
    data = json.dumps(wire, separators=(",", ":"))
    return f"id: {event.seq}\nevent: {event.type}\ndata: {data}\n\n"


class EventStream:
    """Async iterator of SSE frames for one job; store reads run in threads under a limiter."""

    def __init__(
        self,
        store: JobStore,
        job_id: str,
        after_seq: int,
        *,
        block_ms: int,
        keepalive_s: float,
        limiter: anyio.CapacityLimiter,
        guard: StreamGuard,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.after_seq = after_seq
        self.block_ms = block_ms
        self.keepalive_s = keepalive_s
        self.limiter = limiter
        self.guard = guard

    async def _read(self, block_ms: int | None) -> list[JobEvent]:
        call = functools.partial(
            self.store.events, self.job_id, after_seq=self.after_seq, block_ms=block_ms
        )
        return await anyio.to_thread.run_sync(call, limiter=self.limiter)

    async def _finished(self) -> bool:
        record = await anyio.to_thread.run_sync(self.store.get, self.job_id, limiter=self.limiter)
        return is_terminal(record.state)

    async def frames(self) -> AsyncIterator[str]:
        """Frames until the terminal event (or at once if the job ended before `after_seq`).

        A stream the guard ends stops after the last whole event it sent: the client resumes
        with `Last-Event-ID` and loses nothing.
        """
        last_sent = time.monotonic()
        while True:
            reason = await self.guard.ended()
            if reason is not None:
                yield closing_frame(reason)
                return
            events = await self._read(self.guard.block_ms(self.block_ms))
            if not events and await self._finished():
                # The terminal event is written with the state: read once more, then stop.
                events = await self._read(None)
                if not events:
                    return
            for event in events:
                self.after_seq = event.seq
                yield format_event(event)
                if is_terminal(event.type):
                    return
            if events:
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= self.keepalive_s:
                last_sent = time.monotonic()
                yield ": keep-alive\n\n"


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
