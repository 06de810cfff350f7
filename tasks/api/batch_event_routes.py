"""A batch's events as server-sent events: throttled `batch.progress`, then its end.

A batch has no event stream of its own: its counters move with every job. The route reads the
batch at most every `POLL_S` and sends `batch.progress` (data: the batch view) when the view has
changed, at most once per `KILN_BATCH_PROGRESS_INTERVAL_S`; the end (`batch.completed`,
`batch.failed`, `batch.expired` or `batch.canceled`, named by `contract.batches.batch_event_of`)
goes out at once and closes the stream. The first frame is the view as it is when the stream
opens. Streams count against the same caps as job event streams, and end as early (their
lifetime, a fair share, a revoked key: `sse.StreamGuard`); a client reconnects for the view.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread

from kiln.storage.errors import BatchNotFound
from kiln.tasks.api.batch_deps import Batches, BatchId, visible_batch
from kiln.tasks.api.deps import Authorization, Caller, Ctx, api_router, json_error_docs
from kiln.tasks.api.event_routes import EventStreamResponse, event_stream_response, stream_guard
from kiln.tasks.api.sse import StreamGuard, closing_frame
from kiln.tasks.batches.service import BatchService
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import BATCHES_PATH, BatchEvent, BatchView, batch_event_of

router = api_router()
# how often an open stream reads its batch (one HGETALL): an end is reported within this
POLL_S = 0.5


def format_batch_event(event: BatchEvent, view: BatchView) -> str:
    """One SSE frame: `event` is the batch event, `data` the batch view."""
    data = json.dumps(view.model_dump(mode="json"), separators=(",", ":"))
    return f"event: {event}\ndata: {data}\n\n"


def _progress_key(view: BatchView) -> tuple[object, ...]:
    # what a progress frame reports: a view differing only in its clock-driven fields is no news
    return (view.status, view.counts, view.results_written, view.cancel_requested)


class BatchEventStream:
    """Async iterator of one batch's SSE frames; store reads run in threads under a limiter."""

    def __init__(
        self,
        service: BatchService,
        batch_id: str,
        *,
        interval_s: float,
        keepalive_s: float,
        limiter: anyio.CapacityLimiter,
        guard: StreamGuard,
    ) -> None:
        self.service = service
        self.batch_id = batch_id
        self.interval_s = interval_s
        self.keepalive_s = keepalive_s
        self.limiter = limiter
        self.guard = guard

    async def _view(self) -> BatchView:
        batch = await anyio.to_thread.run_sync(
            self.service.get, self.batch_id, limiter=self.limiter
        )
        return batch_view(batch)

    async def frames(self) -> AsyncIterator[str]:
        """The view now, then progress when it changes (throttled), then the end."""
        sent: tuple[object, ...] | None = None
        sent_at = last_frame = float("-inf")
        while True:
            reason = await self.guard.ended()
            if reason is not None:  # the client reconnects: its first frame is the view then
                yield closing_frame(reason)
                return
            try:
                view = await self._view()
            except BatchNotFound:  # its record expired (retention) while the stream was open
                return
            event = batch_event_of(view.status, view.outcome)
            now = time.monotonic()
            if event is not BatchEvent.progress:
                yield format_batch_event(event, view)
                return
            if _progress_key(view) != sent and now - sent_at >= self.interval_s:
                sent, sent_at = _progress_key(view), now
                last_frame = now
                yield format_batch_event(event, view)
            elif now - last_frame >= self.keepalive_s:
                last_frame = now
                yield ": keep-alive\n\n"
            pause_ms = self.guard.block_ms(int(min(POLL_S, max(self.interval_s, 0.05)) * 1000))
            await anyio.sleep(pause_ms / 1000)


@router.get(
    BATCHES_PATH + "/{batch_id}/events",
    response_class=EventStreamResponse,
    responses={
        200: {
            "description": "Server-sent events: `event` = batch.progress (throttled) or the "
            "end (batch.completed, batch.failed, batch.expired, batch.canceled), `data` = the "
            "batch view. Ends after the end event.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **json_error_docs(401, 403, 404, 429),
    },
    tags=["batches"],
)
def batch_events(
    ctx: Ctx, caller: Caller, header: Authorization, service: Batches, batch_id: BatchId
) -> EventStreamResponse:
    """The batch's progress and end as server-sent events."""
    visible_batch(service, caller, batch_id)
    guard = stream_guard(ctx, caller, header)
    stream = BatchEventStream(
        service,
        batch_id,
        interval_s=ctx.settings.batch_progress_interval_s,
        keepalive_s=ctx.settings.sse_keepalive_s,
        limiter=ctx.sse_limiter,
        guard=guard,
    )
    return event_stream_response(stream.frames(), guard)
