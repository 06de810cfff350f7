"""Steering a batch: cancel, pause and resume its feeding, retry its failed or expired lines.

A change the batch's status does not allow is a 409 whose `detail` names the status (asking for
the status a batch is already in answers its view). Each answers the batch's view as it is after
the change; the retry answers the new batch (201), or the one its `Idempotency-Key` made (200),
and is a 409 naming the retry while a retry of the same lines has not ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import anyio.to_thread
from fastapi import Header, HTTPException, Query
from fastapi.responses import JSONResponse

from kiln.storage.batch_records import BatchConflict, RetryKeyBound, RetryRunning
from kiln.storage.batch_store import FedBatch
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.batch_deps import CONTROL_ERRORS, Batches, BatchId, conflict, visible_batch
from kiln.tasks.api.deps import Caller, api_router, field_error
from kiln.tasks.batches.retry import NothingToRetry
from kiln.tasks.batches.service import BatchService
from kiln.tasks.batches.views import batch_view
from kiln.tasks.contract.batches import (
    BATCHES_PATH,
    DEFAULT_RETRY_INCLUDE,
    BatchView,
    RetryInclude,
)

router = api_router()
ONE_BATCH = BATCHES_PATH + "/{batch_id}"


@router.post(
    ONE_BATCH + "/cancel", response_model=BatchView, responses=CONTROL_ERRORS, tags=["batches"]
)
def cancel_batch(caller: Caller, service: Batches, batch_id: BatchId) -> BatchView:
    """Stop feeding; queued jobs are canceled, running ones at their next step."""
    return _change(service, caller, batch_id, service.cancel)


@router.post(
    ONE_BATCH + "/pause", response_model=BatchView, responses=CONTROL_ERRORS, tags=["batches"]
)
def pause_batch(caller: Caller, service: Batches, batch_id: BatchId) -> BatchView:
    """Feed nothing new and pause its fed lines (queued at once, running at their next step)."""
    return _change(service, caller, batch_id, service.pause)


@router.post(
    ONE_BATCH + "/resume", response_model=BatchView, responses=CONTROL_ERRORS, tags=["batches"]
)
def resume_batch(caller: Caller, service: Batches, batch_id: BatchId) -> BatchView:
    """Feed a paused batch again and resume its paused lines."""
    return _change(service, caller, batch_id, service.resume)


def _change(
    service: BatchService, caller: Principal, batch_id: str, change: Callable[[str], FedBatch]
) -> BatchView:
    """Apply `change` to a batch the caller may see; 409 naming the state it cannot leave."""
    visible_batch(service, caller, batch_id)
    try:
        return batch_view(change(batch_id))
    except BatchConflict as exc:
        raise conflict(exc) from exc


def _statuses(include: str) -> frozenset[str]:
    names = [part.strip() for part in include.split(",") if part.strip()]
    known = {str(choice) for choice in RetryInclude}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        msg = f"include must be a comma-separated subset of {sorted(known)}; got {include!r}"
        raise field_error(("query", "include"), msg, "include", include)
    return frozenset(names)


@router.post(
    ONE_BATCH + "/retry",
    status_code=201,
    response_model=BatchView,
    responses=CONTROL_ERRORS,
    tags=["batches"],
)
async def retry_batch(
    caller: Caller,
    service: Batches,
    batch_id: BatchId,
    include: Annotated[
        str,
        Query(
            max_length=64,
            description="Lines to run again: any of failed, expired, canceled (default: all).",
        ),
    ] = DEFAULT_RETRY_INCLUDE,
    idempotency_key: Annotated[
        str | None,
        Header(alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$"),
    ] = None,
) -> JSONResponse:
    """A new batch of a finished batch's failed, expired and/or canceled lines (same custom_ids).

    Made once: a repeated `Idempotency-Key` answers the same retry (200); while a retry of the
    same lines has not ended, another is a 409 naming it.
    """
    statuses = _statuses(include)
    await anyio.to_thread.run_sync(visible_batch, service, caller, batch_id)
    # Keys are scoped to the API key so two callers never share one.
    scoped_key = f"{caller.key_id or '-'}:{idempotency_key}" if idempotency_key else None
    try:
        # streams the parent's results and input through the object store: off the event loop
        retry, created = await anyio.to_thread.run_sync(
            service.retry_once, batch_id, statuses, scoped_key
        )
    except BatchConflict as exc:
        raise conflict(exc) from exc
    except (RetryRunning, RetryKeyBound) as exc:
        raise HTTPException(409, str(exc)) from exc  # names the retry that holds the lines
    except NothingToRetry as exc:
        raise field_error(("query", "include"), str(exc), "nothing_to_retry", include) from exc
    view = batch_view(retry).model_dump(mode="json")
    return JSONResponse(view, status_code=201 if created else 200)
