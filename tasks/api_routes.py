"""Routes of the HTTP API (`/v1/jobs`, events, webhooks, nodes, health); see `tasks.api`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Query, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from storage.keys import valid_id
from storage.status import JobRecord, JobState
from tasks.api import ApiContext
from tasks.api_deps import (
    AUTH_ERRORS,
    JOB_ERRORS,
    Caller,
    Ctx,
    JobId,
    error_docs,
    field_error,
    json_error_docs,
    no_unknown_query,
    visible_job,
)
from tasks.api_limits import refuse_over_limits
from tasks.api_models import (
    CancelResult,
    Health,
    JobList,
    NodeList,
    PipelineList,
    Readiness,
    WebhookAttempts,
    WebhookAttemptView,
)
from tasks.auth import Principal
from tasks.json_guard import StrictJsonRoute
from tasks.schemas import JobRequest, JobStatus, JobView, job_view
from tasks.sse import EventStream
from tasks.ssrf import UnsafeUrl, check_url
from tasks.submit import UnknownPipeline
from tasks.webhooks import enqueue_webhook_events

log = logging.getLogger(__name__)
REDIS_DOWN = "job store (Redis) unavailable"
router = APIRouter(dependencies=[Depends(no_unknown_query)], route_class=StrictJsonRoute)
# Event ids are Redis stream ids `<seq>-0`, and Redis takes at most 64 bits: above that the stream
# read fails after the 200 has gone out.
MAX_SEQ = 2**64 - 1


def _admit(ctx: ApiContext) -> None:
    limit = ctx.settings.max_queue_depth
    if limit is not None and ctx.store.queue_depth() >= limit:
        retry_after = str(ctx.settings.queue_full_retry_after_s)
        raise HTTPException(429, "queue is full; retry later", headers={"Retry-After": retry_after})


def _check_request(ctx: ApiContext, request: JobRequest) -> None:
    known = ctx.submitter.known_pipelines()
    if request.pipeline not in known:
        msg = f"unknown pipeline {request.pipeline!r}; served: {', '.join(known) or 'none'}"
        loc = ("body", "pipeline")
        raise field_error(loc, msg, "unknown_pipeline", request.pipeline, known=known)
    refuse_over_limits(ctx.submitter, request)
    if request.webhook is None:
        return
    url_loc = ("body", "webhook", "url")
    secret = ctx.settings.webhook_secret
    if secret is None or not secret.get_secret_value():
        msg = "webhooks are not configured on this server (no KILN_WEBHOOK_SECRET)"
        raise field_error(url_loc, msg, "webhooks_disabled", request.webhook.url)
    try:
        check_url(request.webhook.url, ctx.policy, ctx.resolve)
    except UnsafeUrl as exc:
        raise field_error(url_loc, f"refused: {exc}", "unsafe_url", request.webhook.url) from exc


@router.post(
    "/v1/jobs",
    status_code=201,
    response_model=JobView,
    responses={
        200: {"model": JobView, "description": "Idempotent replay"},
        **error_docs(400, 401, 409, 413, 429),
    },
    tags=["jobs"],
)
def submit_job(
    ctx: Ctx,
    caller: Caller,
    body: JobRequest,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"),
    ] = None,
) -> JobView:
    """Enqueue a job: 201 with its view; 200 with the same job for a repeated Idempotency-Key."""
    _admit(ctx)
    _check_request(ctx, body)
    # Keys are scoped to the API key so two callers never share one.
    scoped_key = f"{caller.key_id or '-'}:{idempotency_key}" if idempotency_key else None
    try:
        record, created = ctx.submitter.submit(
            body, owner=caller.key_id, idempotency_key=scoped_key
        )
    except UnknownPipeline as exc:
        raise field_error(
            ("body", "pipeline"), str(exc), "unknown_pipeline", exc.name, known=exc.known
        ) from exc
    except ValidationError as exc:
        # The Submitter re-checks limits against heartbeats that may have changed since
        # _check_request: still the caller's request that is over them, so still a 422.
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]
        raise RequestValidationError(errors) from exc
    response.status_code = 201 if created else 200
    return job_view(record, ctx.objects, ctx.store.served_pipelines())


@router.get("/v1/jobs/{job_id}", response_model=JobView, responses=JOB_ERRORS, tags=["jobs"])
def get_job(ctx: Ctx, caller: Caller, job_id: JobId) -> JobView:
    """A job's view; output URLs are presigned now."""
    record = visible_job(ctx, caller, job_id)
    return job_view(record, ctx.objects, ctx.store.served_pipelines())


@router.post(
    "/v1/jobs/{job_id}/cancel", response_model=CancelResult, responses=JOB_ERRORS, tags=["jobs"]
)
def cancel_job(ctx: Ctx, caller: Caller, job_id: JobId) -> CancelResult:
    """Cancel: a queued job at once, a running one at its next step; a finished one is left."""
    record = visible_job(ctx, caller, job_id)
    if record.state not in (JobState.QUEUED, JobState.RUNNING):
        return CancelResult(effect="already_finished", job=job_view(record, ctx.objects))
    after = ctx.store.cancel(job_id)
    if after.state == JobState.CANCELED:
        enqueue_webhook_events(ctx.store, job_id, str(after.state), record=after, app=ctx.celery)
        return CancelResult(effect="canceled", job=job_view(after, ctx.objects))
    if after.state == JobState.RUNNING:
        return CancelResult(effect="cancel_requested", job=job_view(after, ctx.objects))
    return CancelResult(effect="already_finished", job=job_view(after, ctx.objects))


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


EVENTS_DOC: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Server-sent events: `id` = seq, `event` = type, `data` = the event as "
        "JSON ({seq, type, time, payload}). Ends after the terminal event.",
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
    release = ctx.sse_slots.acquire(caller.key_id or "-")
    if release is None:
        retry_after = str(ctx.settings.sse_busy_retry_after_s)
        raise HTTPException(
            429, "too many open event streams; retry later", headers={"Retry-After": retry_after}
        )
    stream = EventStream(
        ctx.store,
        job_id,
        start,
        block_ms=ctx.settings.sse_block_ms,
        keepalive_s=ctx.settings.sse_keepalive_s,
        limiter=ctx.sse_limiter,
    )
    response = EventStreamResponse(
        stream.frames(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    response.on_close = release
    return response


@router.get("/v1/jobs", response_model=JobList, responses=error_docs(401, 403), tags=["jobs"])
def list_jobs(
    ctx: Ctx,
    caller: Caller,
    status: JobStatus | None = None,
    batch_id: Annotated[str | None, Query(max_length=128)] = None,
    owner: Annotated[str | None, Query(max_length=128, description="Admin keys only.")] = None,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> JobList:
    """Jobs newest first, filtered; a non-admin key sees only its own."""
    if not caller.admin:
        if owner is not None and owner != caller.key_id:
            raise HTTPException(403, "only admin keys may list another key's jobs")
        owner = caller.key_id
    if (batch_id is not None and not valid_id(batch_id)) or (owner is not None and not owner):
        return JobList(jobs=[], next_cursor=None)
    records, next_cursor = _page(ctx, owner, status, batch_id, cursor, limit)
    return JobList(jobs=[job_view(r, ctx.objects) for r in records], next_cursor=next_cursor)


def _page(
    ctx: ApiContext,
    owner: str | None,
    status: str | None,
    batch_id: str | None,
    cursor: str | None,
    limit: int,
) -> tuple[list[JobRecord], str | None]:
    try:
        return ctx.store.list_jobs(
            owner=owner,
            state=JobState(status) if status else None,
            batch_id=batch_id,
            cursor=cursor,
            limit=min(limit, ctx.settings.list_limit_max),
        )
    except ValueError as exc:
        raise field_error(("query", "cursor"), f"invalid cursor: {exc}", "cursor", cursor) from exc


@router.get(
    "/v1/jobs/{job_id}/webhooks",
    response_model=WebhookAttempts,
    responses=JOB_ERRORS,
    tags=["webhooks"],
)
def webhook_attempts(ctx: Ctx, caller: Caller, job_id: JobId) -> WebhookAttempts:
    """Every webhook delivery attempt of the job (status code, latency, error, outcome)."""
    visible_job(ctx, caller, job_id)
    attempts = [WebhookAttemptView.model_validate(a) for a in ctx.store.webhook_attempts(job_id)]
    return WebhookAttempts(attempts=attempts)


@router.get("/v1/nodes", response_model=NodeList, responses=AUTH_ERRORS, tags=["operations"])
def nodes(ctx: Ctx, caller: Caller) -> NodeList:
    """Live worker nodes from their heartbeats; process ids for admin keys only."""
    return NodeList(nodes=[_node_for(caller, node) for node in ctx.store.live_nodes()])


PID_KEYS = frozenset({"pid", "pids"})


def _node_for(caller: Principal, info: Any) -> Any:
    # Process ids help an operator (and an attacker on the host): admin keys only.
    if caller.admin:
        return info
    if isinstance(info, dict):
        return {k: _node_for(caller, v) for k, v in info.items() if k not in PID_KEYS}
    if isinstance(info, list):
        return [_node_for(caller, item) for item in info]
    return info


@router.get("/v1/pipelines", response_model=PipelineList, responses=AUTH_ERRORS, tags=["jobs"])
def pipelines(ctx: Ctx, caller: Caller) -> PipelineList:
    """Pipeline names jobs may name."""
    return PipelineList(pipelines=ctx.submitter.known_pipelines())


@router.get("/healthz", response_model=Health, tags=["operations"])
def healthz() -> Health:
    """Liveness: the process answers (no dependencies checked)."""
    return Health()


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready"}},
    tags=["operations"],
)
def readyz(
    ctx: Ctx, pipeline: Annotated[str | None, Query(max_length=64)] = None
) -> Readiness | JSONResponse:
    """Ready when Redis answers and a live node serves the pipeline (any, if none named)."""
    try:
        nodes = ctx.store.live_nodes()
    except Exception as exc:  # readiness reports any failure, it never raises
        # a fixed reason: the error text names hosts and ports (it stays in the log)
        log.warning("readiness: the job store did not answer: %s", exc)
        body = Readiness(
            ready=False, redis=False, live_nodes=0, served_pipelines=[], reason=REDIS_DOWN
        )
        return JSONResponse(body.model_dump(mode="json"), status_code=503)
    served = sorted({str(p) for node in nodes for p in node.get("pipelines", [])})
    reason = None
    if not nodes:
        reason = "no live worker node (jobs wait in their queue)"
    elif pipeline is not None and pipeline not in served:
        reason = f"no live node serves pipeline {pipeline!r}"
    body = Readiness(
        ready=reason is None,
        redis=True,
        live_nodes=len(nodes),
        served_pipelines=served,
        reason=reason,
    )
    if reason is not None:
        return JSONResponse(body.model_dump(mode="json"), status_code=503)
    return body
