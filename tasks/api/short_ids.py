"""The `id_prefix` filter of GET /v1/jobs and GET /v1/batches: what a short id may mean.

A client that holds only the first characters of an id (the CLI accepts any unique prefix of
`MIN_ID_PREFIX` or more) asks which visible jobs or batches start with them; one match is the
id, several are listed to choose from.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

from kiln.common.states import JobState
from kiln.storage.id_prefix import batch_ids_with_prefix, job_ids_with_prefix
from kiln.storage.keys import MIN_ID_PREFIX
from kiln.tasks.api.context import ApiContext
from kiln.tasks.batches.service import BatchService
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import BatchList
from kiln.tasks.contract.responses import JobList
from kiln.tasks.contract.views import job_view

IdPrefix = Annotated[
    str | None,
    Query(
        min_length=MIN_ID_PREFIX,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_\-]*$",
        description="Only ids that start with this (newest first; no cursor).",
    ),
]


def jobs_with_prefix(
    ctx: ApiContext,
    owner: str | None,
    prefix: str,
    limit: int,
    state: JobState | None = None,
    batch_id: str | None = None,
) -> JobList:
    """The jobs (`owner`'s, or any; in `state`, of `batch_id` if given) starting with `prefix`."""
    filtered = state is not None or batch_id is not None  # then read more ids than shown
    ids = job_ids_with_prefix(
        ctx.store.redis, ctx.store.keys, prefix, owner, limit=1000 if filtered else limit
    )
    records = [
        record
        for record in ctx.store.get_many(ids)
        if record is not None
        and (state is None or record.state == state)
        and (batch_id is None or record.batch_id == batch_id)
    ][:limit]
    return JobList(jobs=[job_view(record, ctx.objects) for record in records], next_cursor=None)


def batches_with_prefix(
    service: BatchService, owner: str | None, prefix: str, limit: int
) -> BatchList:
    """The batches (of `owner`, or any) whose id starts with `prefix`, newest first."""
    store = service.batches
    ids = batch_ids_with_prefix(store.redis, store.keys, prefix, owner, limit)
    batches = [batch for batch in store.get_fed_many(ids) if batch is not None]
    return BatchList(batches=[batch_view(batch) for batch in batches], next_cursor=None)
