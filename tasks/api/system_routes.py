"""The operations routes: live nodes, known pipelines, liveness and readiness."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Depends, Query
from fastapi.responses import JSONResponse

from kiln.tasks.api.auth import Principal
from kiln.tasks.api.deps import AUTH_ERRORS, Caller, Ctx, api_router, principal
from kiln.tasks.contract.responses import Health, NodeList, PipelineList, Readiness

log = logging.getLogger(__name__)
REDIS_DOWN = "job store (Redis) unavailable"
router = api_router()


@router.get("/v1/nodes", response_model=NodeList, responses=AUTH_ERRORS, tags=["operations"])
def nodes(ctx: Ctx, caller: Caller) -> NodeList:
    """Live worker nodes from their heartbeats; process ids for admin keys only."""
    return NodeList(
        nodes=[_node_for(caller, node) for node in ctx.store.live_nodes()],
        paused_queues=sorted(ctx.store.paused_queues()),
        drain_requests=sorted(ctx.store.drain_requests()),
    )


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


@router.get(
    "/v1/pipelines",
    response_model=PipelineList,
    responses=AUTH_ERRORS,
    tags=["jobs"],
    dependencies=[Depends(principal)],  # any valid key; who the caller is does not matter
)
def pipelines(ctx: Ctx) -> PipelineList:
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
