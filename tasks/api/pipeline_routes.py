"""`GET /v1/pipelines/{name}`: a pipeline's schema, fields, previews, limits, adapters, backlog."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Path

from kiln.tasks.api.deps import Ctx, api_router, error_docs, principal
from kiln.tasks.contract.limits import PipelineLimits
from kiln.tasks.contract.loras import adapter_listing
from kiln.tasks.contract.request_check import announced_fields, announces_previews
from kiln.tasks.contract.responses import AdapterInfo, PipelineBacklogView, PipelineInfo
from kiln.tasks.queue.backlog import lane_targets, node_counts, read_backlog

router = api_router()
PREVIEW_LIMITS = frozenset({"max_preview_side", "min_preview_every_steps"})
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
    """What the pipeline takes, as live nodes announce it, and its backlog."""
    declared = ctx.submitter.declared(name)  # one read of the heartbeats
    if name not in declared.known:
        known = ", ".join(declared.known) or "none"
        raise HTTPException(404, f"no pipeline {name!r}; known: {known}")
    counts = node_counts(ctx.store.live_nodes(), name)
    backlog = read_backlog(ctx.store, ctx.settings, name)
    previews = announces_previews(declared.inputs)
    limits = (declared.limits[0] if declared.limits else PipelineLimits()).to_dict()
    if not previews:  # no preview limits for a pipeline that cannot emit previews
        limits = {key: value for key, value in limits.items() if key not in PREVIEW_LIMITS}
    return PipelineInfo(
        name=name,
        live_nodes=counts.live,
        inputs=declared.inputs[0] if declared.inputs else None,
        fields=announced_fields(declared.inputs),
        previews=previews,
        limits=limits,
        adapters=[AdapterInfo(**entry) for entry in adapter_listing(declared.adapters)],
        backlog=PipelineBacklogView(
            queued=backlog.queued,
            queued_gpu_seconds=backlog.queued_gpu_s,
            job_gpu_seconds=backlog.job_gpu_s,
            running_jobs=backlog.running_jobs,
            nodes={"live": counts.live, "asleep": counts.asleep, "draining": counts.draining},
            desired_nodes=backlog.desired_nodes,
            target_start_s={str(k): v for k, v in lane_targets(ctx.settings).items()},
            expected_wait_s=backlog.expected_wait_s,
        ),
    )
