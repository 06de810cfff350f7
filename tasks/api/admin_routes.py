"""Operator routes under /v1/admin, for admin API keys only (docs/operations.md §10).

Pause, resume and purge queues, drain nodes. Each is a call into tasks.queue.controls; nodes apply
pauses and drains at their next poll.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query

from kiln.tasks.api.auth import Principal
from kiln.tasks.api.deps import Admin, Ctx, admin, api_router, error_docs, field_error
from kiln.tasks.contract.responses import (
    DrainResult,
    PurgeResult,
    QueueControl,
    QueueList,
    QueueView,
)
from kiln.tasks.queue import controls
from kiln.tasks.webhooks.event_sink import EventSink

router = api_router()
router.dependencies.append(Depends(admin))  # every route: 403 unless the key is an admin's
ADMIN_ERRORS = error_docs(401, 403)
QueueName = Annotated[
    str, Path(max_length=80, description="`<lane>.<pipeline>`, e.g. `bulk.tiny`.")
]
NodeId = Annotated[str, Path(max_length=256, description="A node id (see GET /v1/nodes).")]


def _queue(queue: str) -> str:
    try:
        controls.parse_queue(queue)
    except controls.InvalidQueue as exc:
        raise field_error(("path", "queue"), str(exc), "queue_name", queue) from exc
    return queue


def _by(caller: Principal) -> str:
    return caller.name or caller.key_id or ""


@router.get("/v1/admin/queues", response_model=QueueList, responses=ADMIN_ERRORS, tags=["admin"])
def list_queues(ctx: Ctx) -> QueueList:
    """The queues of every known pipeline and every paused queue, with their queued jobs."""
    states = controls.queue_states(ctx.store, ctx.submitter.known_pipelines())
    return QueueList(
        queues=[
            QueueView(
                queue=s.queue,
                queued=s.queued,
                paused=s.paused,
                paused_at=s.paused_at,
                paused_by=s.paused_by,
            )
            for s in states
        ]
    )


@router.post(
    "/v1/admin/queues/{queue}/pause",
    response_model=QueueControl,
    responses=ADMIN_ERRORS,
    tags=["admin"],
)
def pause_queue(ctx: Ctx, caller: Admin, queue: QueueName) -> QueueControl:
    """Pause a queue on every node: its jobs stay queued, running ones go on."""
    changed = controls.pause(ctx.store, _queue(queue), by=_by(caller))
    return QueueControl(queue=queue, paused=True, changed=changed)


@router.post(
    "/v1/admin/queues/{queue}/resume",
    response_model=QueueControl,
    responses=ADMIN_ERRORS,
    tags=["admin"],
)
def resume_queue(ctx: Ctx, queue: QueueName) -> QueueControl:
    """Resume a paused queue on every node."""
    changed = controls.resume(ctx.store, _queue(queue))
    return QueueControl(queue=queue, paused=False, changed=changed)


@router.post(
    "/v1/admin/queues/{queue}/purge",
    response_model=PurgeResult,
    responses=ADMIN_ERRORS,
    tags=["admin"],
)
def purge_queue(ctx: Ctx, queue: QueueName) -> PurgeResult:
    """Cancel every job queued in the queue now (events, webhooks); running jobs go on."""
    events = EventSink(ctx.store, ctx.celery)
    job_ids = controls.purge(ctx.store, _queue(queue), on_canceled=events.changed)
    return PurgeResult(queue=queue, canceled=len(job_ids), job_ids=job_ids)


@router.post(
    "/v1/admin/nodes/{node_id}/drain",
    response_model=DrainResult,
    responses=ADMIN_ERRORS,
    tags=["admin"],
)
def drain_node(
    ctx: Ctx,
    caller: Admin,
    node_id: NodeId,
    exit: Annotated[bool, Query(description="Exit once idle, else stay up idle.")] = False,
) -> DrainResult:
    """Ask a node to finish its running jobs and take no new ones (then exit, with `exit`)."""
    controls.drain(ctx.store, node_id, exit=exit, by=_by(caller))
    return DrainResult(node_id=node_id, drain_requested=True, exit=exit)


@router.delete(
    "/v1/admin/nodes/{node_id}/drain",
    response_model=DrainResult,
    responses=ADMIN_ERRORS,
    tags=["admin"],
)
def undrain_node(ctx: Ctx, node_id: NodeId) -> DrainResult:
    """Withdraw a node's drain request: a node still up takes jobs again."""
    controls.undrain(ctx.store, node_id)
    return DrainResult(node_id=node_id, drain_requested=False)
