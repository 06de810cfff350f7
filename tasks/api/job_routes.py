"""The job routes of the HTTP API: submit, get, cancel, list, and a job's webhook attempts."""

from __future__ import annotations

from typing import Annotated

from fastapi import Header, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool

from kiln.common.states import JobState
from kiln.common.tracing import (
    ADMISSION_SPAN,
    JOB_ID_ATTRIBUTE,
    QUEUE_ATTRIBUTE,
    Carrier,
    SpanKind,
    given_carrier,
    job_carrier,
    set_span_attributes,
    span,
)
from kiln.storage.creation import QueueFull
from kiln.storage.errors import QuotaExceeded
from kiln.storage.job_store import JobRecord, NewJob
from kiln.storage.keys import valid_id
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.context import ApiContext
from kiln.tasks.api.deps import (
    JOB_ERRORS,
    Caller,
    Ctx,
    JobId,
    api_router,
    error_docs,
    field_error,
    refuse_over_page_limit,
    visible_job,
)
from kiln.tasks.api.short_ids import IdPrefix, jobs_with_prefix
from kiln.tasks.contract.responses import (
    CancelResult,
    JobList,
    WebhookAttempts,
    WebhookAttemptView,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView, QueueEstimate, job_view
from kiln.tasks.intake.refusal import Caller as IntakeCaller
from kiln.tasks.intake.refusal import Refusal, Refused
from kiln.tasks.queue.positions import estimate_from, placement, queue_estimate
from kiln.tasks.webhooks.event_sink import EventSink

router = api_router()
JSON_TYPE = "application/json"


def _http(refusal: Refusal) -> Exception:
    """The intake's refusal as the API answers it: a 422 naming the field, else its status."""
    if refusal.status == 422:
        loc = ("body", *refusal.loc)
        return field_error(loc, refusal.message, refusal.code, refusal.value, **refusal.context)
    headers = None
    if refusal.retry_after_s is not None:
        headers = {"Retry-After": str(refusal.retry_after_s)}
    return HTTPException(refusal.status, refusal.message, headers=headers)


@router.post(
    "/v1/jobs",
    status_code=201,
    response_model=JobView,
    responses={
        200: {"model": JobView, "description": "Idempotent replay"},
        **error_docs(400, 401, 409, 429),
    },
    tags=["jobs"],
)
async def submit_job(
    ctx: Ctx,
    caller: Caller,
    body: JobRequest,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"),
    ] = None,
    traceparent: Annotated[str | None, Header(max_length=128)] = None,
    tracestate: Annotated[str | None, Header(max_length=512)] = None,
) -> Response:
    """Enqueue a job: 201 with its view; 200 with the same job for a repeated Idempotency-Key.

    A W3C `traceparent` (and `tracestate`) makes the job's trace a child of the caller's; without
    one, tracing on, the job's trace starts at this admission (kiln/common/tracing.py).
    """
    given = given_carrier(traceparent, tracestate)
    with span(ADMISSION_SPAN, given, kind=SpanKind.SERVER) as admission:
        return await _admit(ctx, caller, body, idempotency_key, job_carrier(admission, given))


async def _admit(
    ctx: ApiContext,
    caller: Principal,
    body: JobRequest,
    idempotency_key: str | None,
    trace: Carrier,
) -> Response:
    intake, who = ctx.intake, IntakeCaller(caller.key_id, caller.max_queued)
    # Keys are scoped to the API key so two callers never share one.
    scoped_key = f"{caller.key_id or '-'}:{idempotency_key}" if idempotency_key else None
    try:  # the intake's checks (tasks/intake), on the event loop where nothing blocks
        accepted = await intake.admit(body, who, scoped_key=scoped_key, trace=trace)
    except Refused as refused:
        raise _http(refused.refusal) from None
    set_span_attributes(
        {JOB_ID_ATTRIBUTE: accepted.new.id, QUEUE_ATTRIBUTE: accepted.new.queue or ""}
    )
    try:
        record, created, estimate = await _write(ctx, accepted.new, intake.queued_cap(who))
    except (QueueFull, QuotaExceeded) as exc:
        raise _http(intake.write_refusal(exc, who)) from exc
    submitter = ctx.submitter
    # the heartbeats' read may have lapsed while the job was written: read again off the loop
    if submitter.served_is_fresh():
        live = submitter.live_pipelines()
    else:
        live = await run_in_threadpool(submitter.live_pipelines)
    view = job_view(record, ctx.objects, live, estimate)
    # already a JobView: sent as it is, sparing FastAPI's validation of it all over again
    return Response(
        view.model_dump_json(), status_code=201 if created else 200, media_type=JSON_TYPE
    )


async def _write(
    ctx: ApiContext, new: NewJob, max_queued: int | None
) -> tuple[JobRecord, bool, QueueEstimate | None]:
    """Write the accepted job and its message and read its place in line: one Redis round trip.

    The same step checks the queue depth and the key's quota (the intake's step 6). Rarer steps
    that block run on a worker thread: a queue's first message (Celery builds it with the
    broker), a publish (a job written without its message), an idempotent replay's place in line.
    """
    submitter, every = ctx.submitter, ctx.settings.bulk_share_every
    if submitter.message_is_ready(new):
        message = submitter.message_for(new)
    else:
        message = await run_in_threadpool(submitter.message_for, new)
    record, created, snapshot = await ctx.creation().create_and_place(
        new,
        max_queued=max_queued,
        max_depth=ctx.settings.max_queue_depth,
        message=message,
        place=placement(new.lane, new.queue) if new.queue else None,
    )
    if record.published:
        submitter.accepted(record, created)  # a log line: nothing to publish
    else:
        await run_in_threadpool(submitter.accepted, record, created)
    if snapshot is None:  # an idempotent replay: another job, whose place is read on its own
        estimate = await run_in_threadpool(queue_estimate, ctx.store, record, every)
        return record, created, estimate
    return record, created, estimate_from(snapshot, new.lane, every)


@router.get("/v1/jobs/{job_id}", response_model=JobView, responses=JOB_ERRORS, tags=["jobs"])
def get_job(ctx: Ctx, caller: Caller, job_id: JobId) -> JobView:
    """A job's view; output URLs are presigned now; a queued job's place in line and ETA."""
    record = visible_job(ctx, caller, job_id)
    return _full_view(ctx, record)


def _full_view(ctx: ApiContext, record: JobRecord) -> JobView:
    estimate = queue_estimate(ctx.store, record, ctx.settings.bulk_share_every)
    return job_view(record, ctx.objects, ctx.submitter.live_pipelines(), estimate)


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
        EventSink(ctx.store, ctx.celery).changed(after)  # its listeners and webhooks
        return CancelResult(effect="canceled", job=job_view(after, ctx.objects))
    if after.state == JobState.RUNNING:
        return CancelResult(effect="cancel_requested", job=job_view(after, ctx.objects))
    return CancelResult(effect="already_finished", job=job_view(after, ctx.objects))


@router.get("/v1/jobs", response_model=JobList, responses=error_docs(401, 403), tags=["jobs"])
def list_jobs(
    ctx: Ctx,
    caller: Caller,
    status: JobState | None = None,
    batch_id: Annotated[str | None, Query(max_length=128)] = None,
    owner: Annotated[str | None, Query(max_length=128, description="Admin keys only.")] = None,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, description="At most KILN_LIST_LIMIT_MAX.")] = 50,
    id_prefix: IdPrefix = None,
) -> JobList:
    """Jobs newest first, filtered; a non-admin key sees only its own."""
    refuse_over_page_limit(ctx, limit)
    if not caller.admin:
        if owner is not None:  # the contract: the filter itself is for admin keys
            raise HTTPException(403, "only admin keys may filter by owner")
        owner = caller.key_id
    if (batch_id is not None and not valid_id(batch_id)) or (owner is not None and not owner):
        return JobList(jobs=[], next_cursor=None)
    if id_prefix is not None:
        return jobs_with_prefix(ctx, owner, id_prefix, limit, status, batch_id)
    records, next_cursor = _page(ctx, owner, status, batch_id, cursor, limit)
    return JobList(jobs=[job_view(r, ctx.objects) for r in records], next_cursor=next_cursor)


def _page(
    ctx: ApiContext,
    owner: str | None,
    status: JobState | None,
    batch_id: str | None,
    cursor: str | None,
    limit: int,
) -> tuple[list[JobRecord], str | None]:
    try:
        return ctx.store.list_jobs(
            owner=owner,
            state=status,
            batch_id=batch_id,
            cursor=cursor,
            limit=limit,
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
