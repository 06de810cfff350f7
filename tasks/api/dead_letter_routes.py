"""The dead-letter routes: list (owner-scoped, paged as jobs are), show, and redrive.

A non-admin key sees and redrives only its own jobs' dead letters; an admin key sees all and may
filter by owner. A redrive paces its new jobs within the call (`rate` per second), so the call
lasts up to `MAX_REDRIVE_SECONDS`; a longer one is refused up front (a 422 naming `rate`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import HTTPException, Query

from kiln.storage.dead_letters import DeadLetterStore
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
)
from kiln.tasks.contract.dead_letters import (
    MAX_REDRIVE_SECONDS,
    DeadLetterList,
    DeadLetterView,
    RedriveRequest,
    RedriveResult,
)
from kiln.tasks.intake.redrive import chosen_letters, dead_letter_view, redrive

router = api_router()


def dead_letter_store(ctx: ApiContext) -> DeadLetterStore:
    """The dead letters, on the job store's Redis client."""
    return DeadLetterStore(ctx.store.redis, ctx.store.settings)


def _scope(caller: Caller, owner: str | None) -> str | None:
    """Whose dead letters the caller reads: its own, or (admin) `owner`'s or everyone's."""
    if caller.admin:
        return owner
    if owner is not None:
        raise HTTPException(403, "only admin keys may filter by owner")
    return caller.key_id or ""


@router.get(
    "/v1/dead-letters",
    response_model=DeadLetterList,
    responses=error_docs(401, 403),
    tags=["dead letters"],
)
def list_dead_letters(
    ctx: Ctx,
    caller: Caller,
    owner: Annotated[str | None, Query(max_length=128, description="Admin keys only.")] = None,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, description="At most KILN_LIST_LIMIT_MAX.")] = 50,
) -> DeadLetterList:
    """Dead letters newest first; a non-admin key sees only its own jobs'."""
    refuse_over_page_limit(ctx, limit)
    scope = _scope(caller, owner)
    if scope == "":  # a key without an id, or an empty owner: nobody's
        return DeadLetterList(dead_letters=[], next_cursor=None)
    try:
        letters, next_cursor = dead_letter_store(ctx).page(scope, cursor, limit)
    except ValueError as exc:
        raise field_error(("query", "cursor"), f"invalid cursor: {exc}", "cursor", cursor) from exc
    return DeadLetterList(
        dead_letters=[dead_letter_view(letter) for letter in letters], next_cursor=next_cursor
    )


@router.get(
    "/v1/dead-letters/{job_id}",
    response_model=DeadLetterView,
    responses=JOB_ERRORS,
    tags=["dead letters"],
)
def get_dead_letter(ctx: Ctx, caller: Caller, job_id: JobId) -> DeadLetterView:
    """One failed job's dead letter; 404 when it has none, 403 when it is another key's."""
    letter = dead_letter_store(ctx).get(job_id)
    if letter is None:
        raise HTTPException(404, f"no dead letter {job_id!r}")
    if not caller.may_see(letter.owner):
        raise HTTPException(403, "this job belongs to another API key")
    return dead_letter_view(letter)


@router.post(
    "/v1/dead-letters/redrive",
    response_model=RedriveResult,
    responses=error_docs(401, 403),
    tags=["dead letters"],
)
def redrive_dead_letters(ctx: Ctx, caller: Caller, body: RedriveRequest) -> RedriveResult:
    """A new job for each chosen dead letter, `rate` per second; `dry_run` lists them only."""
    letters = dead_letter_store(ctx)
    # ids are checked against the caller as each is redriven (may_see); a filter reads its scope
    scope = None if body.filter is None else _scope(caller, body.filter.owner)
    targets = [] if scope == "" else chosen_letters(letters, body, scope)
    seconds = len(targets) / body.rate
    if not body.dry_run and seconds > MAX_REDRIVE_SECONDS:
        msg = (
            f"{len(targets)} jobs at {body.rate}/s take {seconds:.0f} s, over the "
            f"{MAX_REDRIVE_SECONDS:.0f} s a call may last: raise rate or redrive fewer"
        )
        raise field_error(("body", "rate"), msg, "redrive_too_long", body.rate)
    return redrive(
        ctx.store,
        letters,
        ctx.submitter,
        targets,
        rate=body.rate,
        dry_run=body.dry_run,
        may_see=caller.may_see,
        max_depth=ctx.settings.max_queue_depth,
    )
