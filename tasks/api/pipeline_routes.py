"""`GET /v1/pipelines/{name}`: what a pipeline takes (input schema, limits, adapters)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path

from kiln.tasks.api.deps import Ctx, api_router, error_docs, principal
from kiln.tasks.contract.limits import PipelineLimits
from kiln.tasks.contract.loras import adapter_listing
from kiln.tasks.contract.responses import AdapterInfo, PipelineInfo

router = api_router()
PipelineName = Annotated[
    str,
    Path(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$",
        description="A pipeline name from GET /v1/pipelines.",
    ),
]


@router.get(
    "/v1/pipelines/{name}",
    response_model=PipelineInfo,
    responses=error_docs(401, 404),
    tags=["jobs"],
    dependencies=[Depends(principal)],  # any valid key; who the caller is does not matter
)
def pipeline(ctx: Ctx, name: PipelineName) -> PipelineInfo:
    """The pipeline's input schema (as a live node announces it), limits and adapters."""
    submitter = ctx.submitter
    known = submitter.known_pipelines()
    if name not in known:
        raise HTTPException(404, f"no pipeline {name!r}; known: {', '.join(known) or 'none'}")
    live = sum(1 for node in ctx.store.live_nodes() if name in node.get("pipelines", []))
    schemas = submitter.inputs_for(name)
    limits = submitter.limits_for(name)
    return PipelineInfo(
        name=name,
        live_nodes=live,
        inputs=schemas[0] if schemas else None,
        limits=(limits[0] if limits else PipelineLimits()).to_dict(),
        adapters=[AdapterInfo(**entry) for entry in adapter_listing(submitter.adapters_for(name))],
    )
