"""Response bodies of the HTTP API besides the job view (they shape the OpenAPI document)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from kiln.tasks.contract.views import JobView


class ErrorBody(BaseModel):
    """Body of every non-validation error (401, 403, 404, 409, 413, 429, 503)."""

    detail: str


class JobList(BaseModel):
    """One page of jobs, newest first; pass `next_cursor` as `cursor` for the next page."""

    jobs: list[JobView]
    next_cursor: str | None = None


CancelEffect = Literal["canceled", "cancel_requested", "already_finished"]
# what became of one webhook delivery attempt (webhooks.delivery produces exactly these)
WebhookOutcome = Literal["delivered", "retrying", "gave_up", "gone", "refused"]


class CancelResult(BaseModel):
    """What a cancel did: canceled at once (queued), requested (running), or nothing (finished)."""

    effect: CancelEffect
    job: JobView


# a pause: paused at once (queued), asked of its run (running: it stops at its next step), or
# nothing to do (paused already); a resume: queued again, a pending pause withdrawn, or nothing
PauseEffect = Literal["paused", "pause_requested", "already_paused"]
ResumeEffect = Literal["resumed", "pause_withdrawn", "not_paused"]


class PauseResult(BaseModel):
    """What a pause did (docs/contract.md §4a); a finished job is refused with 409."""

    effect: PauseEffect
    job: JobView


class ResumeResult(BaseModel):
    """What a resume did (docs/contract.md §4a); a finished job is refused with 409."""

    effect: ResumeEffect
    job: JobView


class WebhookAttemptView(BaseModel):
    """One recorded webhook delivery attempt."""

    webhook_id: str
    event: str
    attempt: int
    url: str
    time: float
    status_code: int | None = None
    latency_ms: float | None = None
    error: str | None = None
    outcome: WebhookOutcome = Field(
        description="delivered; retrying (next_attempt_at set); gave_up (schedule exhausted); "
        "gone (410: no more sends to this endpoint); refused (URL or configuration refused)."
    )
    next_attempt_at: float | None = None


class WebhookAttempts(BaseModel):
    """Every webhook delivery attempt of a job, oldest first."""

    attempts: list[WebhookAttemptView]


class Health(BaseModel):
    """Liveness: the process answers."""

    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    """Readiness: Redis reachable and at least one live node serving the pipeline."""

    ready: bool
    redis: bool
    live_nodes: int
    served_pipelines: list[str]
    reason: str | None = None


class NodeList(BaseModel):
    """Live worker nodes as their latest heartbeats describe them.

    Each node says whether it is `draining`, the operator's `drain` request it applies, the
    `paused_queues` among its own and the queues it is `consuming` now.
    """

    nodes: list[dict[str, Any]]
    paused_queues: list[str] = Field(
        default_factory=list, description="Every queue an operator has paused (all nodes)."
    )
    drain_requests: list[str] = Field(
        default_factory=list, description="Node ids with a pending drain request."
    )


class QueueView(BaseModel):
    """One queue (`<lane>.<pipeline>`) as an operator sees it."""

    queue: str
    queued: int = Field(description="Jobs queued in it now.")
    paused: bool
    paused_at: float | None = None
    paused_by: str = ""


class QueueList(BaseModel):
    """The queues of the known pipelines (both lanes), and every paused queue."""

    queues: list[QueueView]


class QueueControl(BaseModel):
    """What a pause or resume did: the queue's state now, and whether it changed."""

    queue: str
    paused: bool
    changed: bool


class PurgeResult(BaseModel):
    """The jobs a purge canceled (each now `canceled`, event reason `purged`), in queue order."""

    queue: str
    canceled: int
    job_ids: list[str]


class DrainResult(BaseModel):
    """A node's drain request as it stands after the call."""

    node_id: str
    drain_requested: bool
    exit: bool = Field(default=False, description="The node exits once idle.")


class PipelineList(BaseModel):
    """Pipelines the API accepts jobs for (configured or announced by a live node)."""

    pipelines: list[str]


class AdapterInfo(BaseModel):
    """A LoRA adapter of a pipeline: the live nodes that offer it, hold it loaded, keep it fused."""

    name: str
    available_on: list[str] = Field(description="Node ids that can load it.")
    loaded_on: list[str] = Field(description="Node ids whose ranks hold it loaded now.")
    fused_on: list[str] = Field(description="Node ids that keep it fused into the weights now.")


class PipelineBacklogView(BaseModel):
    """A pipeline's backlog as autoscalers and admission read it (docs/operations.md §16)."""

    queued: dict[str, int] = Field(description="Queued jobs per lane.")
    queued_gpu_seconds: dict[str, float] = Field(
        description="Queued work per lane in estimated GPU-seconds (jobs × job_gpu_seconds)."
    )
    job_gpu_seconds: float = Field(
        description="What one job counts: the mean run time of the pipeline's runs that ended "
        "in the last ten minutes, or KILN_JOB_GPU_S_UNKNOWN while none did."
    )
    running_jobs: int
    nodes: dict[str, int] = Field(
        description="Live nodes serving it (`live`), and among them `asleep` and `draining`."
    )
    desired_nodes: int = Field(
        description="Nodes that would start every queued job within its lane's target start "
        "(kiln_pipeline_desired_nodes)."
    )
    target_start_s: dict[str, float] = Field(description="Each lane's target start.")
    expected_wait_s: dict[str, float | None] = Field(
        description="Per lane: when a job submitted now is expected to start (s), from the "
        "recent completion rate; null while none is known (nothing ended lately, or paused)."
    )


class PipelineInfo(BaseModel):
    """One pipeline as jobs may use it: its input schema, its limits and its adapters."""

    name: str
    live_nodes: int = Field(description="Live nodes serving the pipeline now.")
    inputs: dict[str, Any] | None = Field(
        description="JSON Schema of the pipeline's inputs, as a live node announces it; "
        "properties with `x-kiln-field` are request fields under the pipeline's own names, "
        "the others go in a job's `inputs`. null while no live node announces one."
    )
    fields: list[str] | None = Field(
        default=None,
        description="The request fields the pipeline honours (`prompt`, `width`, `steps`, "
        "`seed`, ...), as a live node announces them (its `supported_fields()`); null while "
        "none does.",
    )
    previews: bool = Field(
        default=True,
        description="Whether a job may ask for `preview`: false when no live node can decode "
        "the pipeline's previews (then `limits` has no preview limits).",
    )
    limits: dict[str, int | None] = Field(
        description="Sizes, steps, frames, budget and previews the pipeline takes "
        "(docs/contract.md §2)."
    )
    adapters: list[AdapterInfo] = Field(
        default_factory=list, description="LoRA adapters jobs may name in `loras`, by name."
    )
    backlog: PipelineBacklogView | None = Field(
        default=None, description="Its backlog, nodes and expected wait per lane, read now."
    )
