"""`GET /v1/usage`: GPU-seconds, energy and attempts per key or pipeline over a time range.

A key sees its own jobs' totals; an admin key sees every key's and every node's own (held, busy
and idle GPU-seconds). The totals are read from hourly buckets, never from job records
(storage/usage.py, docs/operations.md §21).
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Query

from kiln.storage.usage import usage_totals
from kiln.tasks.api.deps import AUTH_ERRORS, Caller, Ctx, api_router, field_error
from kiln.tasks.contract.usage import GROUP_BY, UsageReport, usage_range

router = api_router()


@router.get(
    "/v1/usage",
    response_model=UsageReport,
    responses=AUTH_ERRORS,  # its 422s are FastAPI's validation errors, documented by it
    tags=["operations"],
)
def usage(
    ctx: Ctx,
    caller: Caller,
    since: Annotated[
        str | None,
        Query(max_length=64, description="Epoch seconds, ISO 8601 or a duration back (24h)."),
    ] = None,
    until: Annotated[
        str | None, Query(max_length=64, description="As since; now if absent.")
    ] = None,
    group_by: Annotated[str, Query(max_length=32, description="key or pipeline.")] = "key",
) -> UsageReport:
    """Totals over [since, until) by whole hours; a key's own only unless it is an admin key."""
    if group_by not in GROUP_BY:
        msg = f"group_by must be one of {', '.join(GROUP_BY)}"
        raise field_error(("query", "group_by"), msg, "literal_error", group_by)
    try:
        start, end = usage_range(since, until, time.time())
    except ValueError as exc:
        name, _, msg = str(exc).partition(": ")
        value = since if name == "since" else until
        raise field_error(("query", name), msg, "value_error", value) from None
    owner = None if caller.admin else caller.key_id
    totals = usage_totals(ctx.store, start, end, "key" if group_by == "key" else "pipeline", owner)
    return UsageReport.model_validate(totals, from_attributes=True)
