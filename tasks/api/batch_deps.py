"""What the batch routes share: the batch service, the batch id parameter, visibility, conflicts."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request

from kiln.storage.batch_records import BatchConflict, FedBatch
from kiln.storage.errors import BatchNotFound
from kiln.tasks.api.auth import Principal
from kiln.tasks.api.deps import error_docs
from kiln.tasks.api.json_guard import body_errors
from kiln.tasks.batches.service import BatchService

BatchId = Annotated[str, Path(max_length=128, description="A batch id.")]
BATCH_ERRORS = error_docs(401, 403, 404)
CONTROL_ERRORS = error_docs(401, 403, 404, 409)


def batch_service(request: Request) -> BatchService:
    """The app's batch service, built on first use from its context."""
    service: BatchService | None = getattr(request.app.state, "kiln_batches", None)
    if service is None:
        ctx = request.app.state.kiln
        depth = ctx.settings.max_json_depth
        if ctx.objects is None:
            raise HTTPException(503, "batches need an object store")
        service = BatchService(
            ctx.store,
            ctx.objects,
            ctx.submitter,
            ctx.settings,
            lambda raw: body_errors(raw, depth),
            policy=ctx.policy,
            resolve=ctx.resolve,
        )
        request.app.state.kiln_batches = service
    return service


Batches = Annotated[BatchService, Depends(batch_service)]


def visible_batch(service: BatchService, caller: Principal, batch_id: str) -> FedBatch:
    """The batch if the caller may see it: 404 if there is none, 403 if it is another key's."""
    try:
        batch = service.get(batch_id)
    except BatchNotFound as exc:
        raise HTTPException(404, f"no batch {batch_id!r}") from exc
    if not caller.may_see(batch.owner):
        raise HTTPException(403, "this batch belongs to another API key")
    return batch


def conflict(exc: BatchConflict) -> HTTPException:
    """The 409 of a change the batch's status does not allow; `detail` names the status."""
    return HTTPException(409, str(exc))
