"""The job routes of the HTTP API: submit, get, cancel, list, and a job's webhook attempts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from fastapi import Header, HTTPException, Query, Response
from fastapi.concurrency import run_in_threadpool

from kiln.common.states import JobState
from kiln.storage.creation import QueueFull
from kiln.storage.errors import QuotaExceeded
from kiln.storage.job_store import JobRecord
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
from kiln.tasks.api.upload_routes import refuse_bad_image_refs
from kiln.tasks.contract.image_refs import ImageRef
from kiln.tasks.contract.request_check import Violation, check_request, image_refs
from kiln.tasks.contract.responses import (
    CancelResult,
    JobList,
    WebhookAttempts,
    WebhookAttemptView,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView, QueueEstimate, job_view
from kiln.tasks.queue.backlog import LateStart, late_start, needs_admission
from kiln.tasks.queue.positions import estimate_from, placement, queue_estimate
from kiln.tasks.queue.quotas import effective_cap
from kiln.tasks.webhooks.enqueue import enqueue_webhook_events
from kiln.tasks.webhooks.ssrf import UnsafeUrl, check_url

router = api_router()
JSON_TYPE = "application/json"


def _refusal(violation: Violation) -> Exception:
    """The 422 of a request the served pipelines refuse: FastAPI's shape, naming the field."""
    loc, context = violation.loc(("body",)), violation.context()
    return field_error(loc, violation.message, violation.kind, violation.value, **context)


def _refuse_by_lookups(
    ctx: ApiContext, caller: Principal, request: JobRequest, refs: Mapping[str, ImageRef]
) -> None:
    """The checks that need I/O, after the one pass: image inputs, then the webhook's URL."""
    refuse_bad_image_refs(ctx, caller, refs)  # an upload's owner and size, a URL's host
    if request.webhook is not None:
        _refuse_unsafe_webhook(ctx, request.webhook.url)


def _refuse_unsafe_webhook(ctx: ApiContext, url: str) -> None:
    """422 when webhooks are not configured, or when `url` fails the SSRF rules (DNS)."""
    url_loc = ("body", "webhook", "url")
    secret = ctx.settings.webhook_secret
    if secret is None or not secret.get_secret_value():
        msg = "webhooks are not configured on this server (no KILN_WEBHOOK_SECRET)"
        raise field_error(url_loc, msg, "webhooks_disabled", url)
    try:
        check_url(url, ctx.policy, ctx.resolve)
    except UnsafeUrl as exc:
        raise field_error(url_loc, f"refused: {exc}", "unsafe_url", url) from exc


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
async def submit_job(
    ctx: Ctx,
    caller: Caller,
    body: JobRequest,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"),
    ] = None,
) -> Response:
    """Enqueue a job: 201 with its view; 200 with the same job for a repeated Idempotency-Key."""
    # Answered on the event loop: a thread hop costs a plain submission more CPU than its own
    # work. What can block goes to a worker thread: reading the nodes' heartbeats (every few
    # seconds), a webhook URL's DNS, an image input's HEAD.
    submitter = ctx.submitter
    if submitter.served_is_fresh():
        declared = submitter.declared(body.pipeline)
    else:
        declared = await run_in_threadpool(submitter.declared, body.pipeline)
    violation = check_request(body, declared)  # every static check, in one pass
    if violation is not None:
        raise _refusal(violation)
    refs = image_refs(body, declared)
    if refs or body.webhook is not None:
        await run_in_threadpool(_refuse_by_lookups, ctx, caller, body, refs)
    # Keys are scoped to the API key so two callers never share one.
    scoped_key = f"{caller.key_id or '-'}:{idempotency_key}" if idempotency_key else None
    if needs_admission(body.priority, body.start_by, ctx.settings):
        await _refuse_late_start(ctx, body, scoped_key)
    max_queued = effective_cap(caller.max_queued, ctx.settings.max_queued_per_key)
    retry_after = {"Retry-After": str(ctx.settings.queue_full_retry_after_s)}
    try:
        record, created, estimate = await _submit(ctx, body, caller, scoped_key, max_queued)
    except QueueFull as exc:
        raise HTTPException(429, "queue is full; retry later", headers=retry_after) from exc
    except QuotaExceeded as exc:
        detail = f"this API key has {max_queued} queued jobs, its maximum; retry later"
        raise HTTPException(429, detail, headers=retry_after) from exc
    view = job_view(record, ctx.objects, ctx.submitter.live_pipelines(), estimate)
    # already a JobView: sent as it is, sparing FastAPI's validation of it all over again
    return Response(
        view.model_dump_json(), status_code=201 if created else 200, media_type=JSON_TYPE
    )


async def _refuse_late_start(ctx: ApiContext, body: JobRequest, scoped_key: str | None) -> None:
    """429 with Retry-After when the backlog cannot start the job in time (admission control).

    The lane's expected wait comes from a backlog read kept for a moment (tasks/queue/backlog.py);
    a replay of an Idempotency-Key that already names a job is let through to get that job.
    """
    backlogs = ctx.backlogs
    if scoped_key is None and backlogs.is_fresh(body.pipeline):
        refusal = _late_start(ctx, body, None)
    else:
        refusal = await run_in_threadpool(_late_start, ctx, body, scoped_key)
    if refusal is not None:
        headers = {"Retry-After": str(refusal.retry_after_s)}
        raise HTTPException(429, refusal.message(), headers=headers)


def _late_start(ctx: ApiContext, body: JobRequest, scoped_key: str | None) -> LateStart | None:
    if scoped_key is not None and ctx.store.idempotency_bound(scoped_key):
        return None
    backlog, now = ctx.backlogs.now(body.pipeline)
    return late_start(backlog, body.priority, body.start_by, ctx.settings, now)


async def _submit(
    ctx: ApiContext,
    body: JobRequest,
    caller: Principal,
    scoped_key: str | None,
    max_queued: int | None,
) -> tuple[JobRecord, bool, QueueEstimate | None]:
    """Write the job and its message and read its place in line: one Redis round trip.

    The same step checks the queue depth and the key's quota. Rarer steps that block run on a
    worker thread: a queue's first message (Celery builds it with the broker), a publish (a job
    written without its message), an idempotent replay's place in line (another job's).
    """
    submitter, every = ctx.submitter, ctx.settings.bulk_share_every
    new = submitter.new_job(body, owner=caller.key_id, idempotency_key=scoped_key)
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
        enqueue_webhook_events(ctx.store, job_id, str(after.state), record=after, app=ctx.celery)
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
