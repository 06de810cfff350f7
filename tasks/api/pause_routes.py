"""Pause and resume a job (docs/contract.md §4a): `POST /v1/jobs/{id}/pause` and `/resume`.

Scoped as a cancel is: the job's own key or an admin key (404 unknown, 403 another's); a finished
job is refused with 409, naming its state. The step itself is tasks/intake/pausing.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import HTTPException

from kiln.tasks.api.context import ApiContext
from kiln.tasks.api.deps import Caller, Ctx, JobId, api_router, error_docs, visible_job
from kiln.tasks.contract.responses import PauseResult, ResumeResult
from kiln.tasks.contract.views import job_view
from kiln.tasks.intake.pausing import JobPausing, PauseRefused
from kiln.tasks.webhooks.event_sink import EventSink

router = api_router()
T = TypeVar("T")
PAUSE_ERRORS = error_docs(401, 403, 404, 409)


def _pausing(ctx: ApiContext) -> JobPausing:
    return JobPausing(ctx.store, ctx.submitter, EventSink(ctx.store, ctx.celery))


def _refused_as_409(step: Callable[[], T]) -> T:
    """`step`'s answer; a finished job's refusal (PauseRefused) is the API's 409 naming why."""
    try:
        return step()
    except PauseRefused as exc:
        raise HTTPException(409, str(exc)) from exc


@router.post(
    "/v1/jobs/{job_id}/pause", response_model=PauseResult, responses=PAUSE_ERRORS, tags=["jobs"]
)
def pause_job(ctx: Ctx, caller: Caller, job_id: JobId) -> PauseResult:
    """Pause: a queued job at once; a running one at its next step, with a step checkpoint."""
    record = visible_job(ctx, caller, job_id)
    effect, after = _refused_as_409(lambda: _pausing(ctx).pause(record))
    return PauseResult(effect=effect, job=job_view(after, ctx.objects))


@router.post(
    "/v1/jobs/{job_id}/resume", response_model=ResumeResult, responses=PAUSE_ERRORS, tags=["jobs"]
)
def resume_job(ctx: Ctx, caller: Caller, job_id: JobId) -> ResumeResult:
    """Resume: a paused job is queued again at the back of its lane; a pending pause withdrawn."""
    record = visible_job(ctx, caller, job_id)
    effect, after = _refused_as_409(lambda: _pausing(ctx).resume(record))
    return ResumeResult(effect=effect, job=job_view(after, ctx.objects))
