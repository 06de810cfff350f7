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
    """Live worker nodes as their latest heartbeats describe them."""

    nodes: list[dict[str, Any]]


class PipelineList(BaseModel):
    """Pipelines the API accepts jobs for (configured or announced by a live node)."""

    pipelines: list[str]
