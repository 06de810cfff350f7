"""Settings of the tasks package (Celery, node worker, API, webhooks): one class, `KILN_` prefix."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kiln.common.defaults import DEADLINE_GRACE_S
from kiln.common.env_lists import comma_or_json_list


class KilnSettings(BaseSettings):
    """Everything the tasks package reads from the environment; built once at each entry point."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    # --- Celery and the node worker -----------------------------------------------------------
    broker_url: str | None = Field(
        default=None, description="Celery broker URL; defaults to KILN_REDIS_URL."
    )
    visibility_timeout_s: int = Field(
        default=3600,
        description="Redis visibility timeout; the lease, not this, prevents double runs.",
    )
    pipelines: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["default", "tiny", "tiny-video"],
        description="Pipeline names the API accepts even while no node announces them "
        "(comma-separated).",
    )
    max_attempts: int = Field(default=3, description="Runs of a job before it is failed for good.")
    quarantine_jobs: int = Field(
        default=3,
        ge=2,
        description="Separate device failures (jobs failing together count once) of as many "
        "different jobs on one node within quarantine_window_s that quarantine it: it takes "
        "no more work until restarted.",
    )
    quarantine_window_s: float = Field(
        default=600.0, gt=0, description="The window quarantine_jobs are counted in (s)."
    )
    retry_backoff_s: float = Field(
        default=2.0, description="First retry delay; doubles per attempt."
    )
    retry_backoff_max_s: float = Field(default=60.0, description="Cap on the retry delay.")
    lease_busy_delay_s: float = Field(
        default=5.0,
        description="Delay before re-publishing a delivery whose lease is held elsewhere.",
    )
    heartbeat_interval_s: float = Field(
        default=2.0, description="Lease renewal and node heartbeat."
    )
    reaper_interval_s: float = Field(
        default=5.0, description="How often each node looks for expired leases."
    )
    node_control_loops: bool = Field(
        default=True,
        description="A node also runs the cluster's loops (reaper, sweeper, audits, pruner, batch "
        "feeder); false when `kiln control` runs them (docs/operations.md §5).",
    )
    sweeper_age_s: float = Field(
        default=30.0,
        description="A queued record never confirmed published for this long is re-published.",
    )
    upload_retry_s: float = Field(
        default=120.0, description="How long a node keeps retrying an unreachable object store."
    )
    upload_verify: Literal["checksum", "head"] = Field(
        default="checksum",
        description="How a node verifies each upload: `checksum` trusts a store that checked the "
        "sent SHA-256 itself and echoed it (S3, MinIO; any other store is still read back), "
        "`head` always reads the object back.",
    )
    progress_interval_s: float = Field(default=0.25, description="Throttle for progress writes.")
    drain_grace_s: float = Field(
        default=30.0,
        description="SIGTERM: time a running job that takes no step checkpoints gets to finish "
        "(one that takes them is handed back at its next step, checkpointed).",
    )
    preemption_notice_url: str | None = Field(
        default=None,
        description="Off when unset. A node polls this metadata URL and drains as on SIGTERM once "
        "it announces the machine's preemption: AWS's spot `instance-action` "
        "(http://169.254.169.254/latest/meta-data/spot/instance-action) or GCE's `preempted` "
        "(http://metadata.google.internal/computeMetadata/v1/instance/preempted).",
    )
    preemption_notice_kind: Literal["aws", "gce"] = Field(
        default="aws",
        description="How to read the notice URL: `aws` (a JSON `instance-action` document; 404: "
        "none) or `gce` (`TRUE`/`FALSE`, asked with `Metadata-Flavor: Google`).",
    )
    preemption_poll_s: float = Field(
        default=2.0, gt=0.0, description="How often a node polls its preemption notice URL (s)."
    )
    checkpoint_every_s: float = Field(
        default=30.0,
        ge=0.0,
        description="A video job's step checkpoints: one at most this often (s); 0: none. A job "
        "with recorded checkpoints resumes from them whatever this says.",
    )
    priority_preemption: bool = Field(
        default=True,
        description="An interactive job waiting past KILN_TARGET_START_S_INTERACTIVE while every "
        "node serving its pipeline runs bulk jobs suspends one of them at its next step "
        "(checkpointed, back at the head of its lane, no attempt counted) so it can start; "
        "only jobs that take step checkpoints (docs/operations.md §20).",
    )
    priority_preemption_min_run_s: float = Field(
        default=30.0,
        ge=0.0,
        description="A job is preempted only after running this long since its latest start "
        "(its first, or its resume after a preemption): bulk work cannot thrash.",
    )
    priority_preemption_max: int = Field(
        default=2,
        ge=0,
        description="Most times one job is preempted; past it, it runs to its end.",
    )
    bulk_share_every: int = Field(
        default=4,
        description="A node lets one bulk job through after this many interactive ones in a row.",
    )
    deadline_grace_s: float = Field(
        default=DEADLINE_GRACE_S,
        description="After max_run_seconds: time for a cooperative stop before the kill.",
    )
    metrics_port: int = Field(
        default=9400,
        ge=0,
        le=65535,
        description="Port of a node's Prometheus /metrics (`kiln worker`); 0 = off.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Address a node's /metrics listens on (as `kiln api`'s, loopback unless set; "
        "containers set 0.0.0.0 for Prometheus).",
    )
    task_events: bool = Field(
        default=False,
        description="Workers send Celery task events (for Flower); producers send task-sent.",
    )
    queued_audit_interval_s: float = Field(
        default=120.0,
        gt=0,
        description="How often one node per queue audits it for queued jobs whose message is lost.",
    )
    queued_audit_age_s: float = Field(
        default=300.0,
        gt=0,
        description="The audit republishes a queued job whose message is in no queue, unacked or "
        "held list only once it has been queued this long.",
    )

    # --- Autoscaling and admission (tasks/queue/backlog.py; docs/operations.md "Autoscaling") --
    target_start_s_interactive: float = Field(
        default=30.0,
        gt=0,
        description="Target start latency of an interactive job: kiln_pipeline_desired_nodes "
        "asks for the nodes that start every queued interactive job within it.",
    )
    target_start_s_bulk: float = Field(
        default=3600.0,
        gt=0,
        description="Target start latency of a bulk job (bulk may wait): likewise for the whole "
        "queue, interactive and bulk.",
    )
    admit_by_target: bool = Field(
        default=False,
        description="Refuse (429) an interactive job without start_by that the backlog cannot "
        "start within KILN_TARGET_START_S_INTERACTIVE, as if it carried that start_by.",
    )
    desired_nodes_max: int = Field(
        default=64, ge=1, description="Most nodes kiln_pipeline_desired_nodes asks for."
    )
    job_gpu_s_unknown: float = Field(
        default=10.0,
        gt=0,
        description="GPU-seconds counted per queued job of a pipeline none of whose runs ended "
        "in the last ten minutes.",
    )
    surplus_exit: bool = Field(
        default=False,
        description="An idle node of a pipeline with more live nodes than desired drains and "
        "exits 0 (for platforms where a node's exit is final: not a Deployment, which restarts).",
    )
    surplus_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a node must be idle and surplus before it drains (a stabilization "
        "window: a node removed and wanted again pays a whole cold start).",
    )

    # --- Logging (every process) --------------------------------------------------------------
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines as text, or one JSON object per line (API, nodes, ranks, Celery).",
    )

    # --- The API and webhooks -----------------------------------------------------------------
    api_host: str = Field(default="127.0.0.1", description="Address `kiln api` listens on.")
    api_port: int = Field(default=8000, ge=0, le=65535, description="Port `kiln api` listens on.")
    api_workers: int = Field(
        default=1,
        ge=1,
        description="API processes serving the one port; above 1, `kiln api` supervises them.",
    )
    api_url: str | None = Field(
        default=None,
        description="The Kiln API the CLI's job, batch and admin commands use (their `--api`); "
        "unset: Redis directly.",
    )
    api_key: SecretStr | None = Field(
        default=None, description="Bearer key the CLI sends to that API (its `--api-key`)."
    )
    auth_enabled: bool = Field(
        default=True, description="Require bearer API keys; switch off only for local use."
    )
    api_key_pepper: SecretStr = Field(
        default=SecretStr(""),
        description="HMAC key for API-key hashes; changing it voids all keys.",
    )
    api_key_cache_s: float = Field(
        default=1.0,
        ge=0,
        description="How long the API keeps a live key's record in memory; a revoked key is "
        "refused at the latest this long after its revocation (0: read on every request).",
    )
    max_body_bytes: int = Field(default=65536, ge=1024, description="Larger request bodies: 413.")
    max_queue_depth: int | None = Field(
        default=100_000, ge=0, description="Queued jobs above which POST /v1/jobs is a 429."
    )
    queue_full_retry_after_s: int = Field(default=5, ge=1, description="Retry-After of a 429.")
    max_queued_per_key: int | None = Field(
        default=None,
        ge=1,
        description="Queued jobs one API key may have; more: 429. Unset: no cap. "
        "`kiln keys create --max-queued` overrides it per key.",
    )
    max_running_per_key: int | None = Field(
        default=None,
        ge=1,
        description="Running jobs one API key may have; a node delays the next. Unset: no cap. "
        "`kiln keys create --max-running` overrides it per key.",
    )
    list_limit_max: int = Field(default=200, ge=1, description="Largest page of GET /v1/jobs.")
    sse_block_ms: int = Field(default=2000, ge=10, description="One blocking SSE read (ms).")
    sse_keepalive_s: float = Field(default=15.0, gt=0, description="SSE comment when this idle.")
    sse_max_streams_per_key: int = Field(
        default=16, ge=1, description="Open event streams one API key may hold; more: 429."
    )
    sse_max_streams_total: int = Field(
        default=64,
        ge=1,
        description="Open event streams in all; more: 429. Must leave Redis connections spare.",
    )
    sse_busy_retry_after_s: int = Field(
        default=2, ge=1, description="Retry-After of a 429 for too many event streams."
    )
    sse_max_lifetime_s: float = Field(
        default=300.0,
        gt=0,
        description="An event stream is ended after this long; clients resume (Last-Event-ID).",
    )
    max_json_depth: int = Field(
        default=32, ge=2, description="Request JSON nested deeper than this: 422."
    )
    http_header_timeout_s: float = Field(
        default=5.0, gt=0, description="Time to send a request line and headers; then closed."
    )
    http_body_timeout_s: float = Field(
        default=10.0, gt=0, description="Time to send a request body after its headers."
    )
    http_keepalive_timeout_s: int = Field(
        default=5, ge=1, description="An idle keep-alive connection is closed after this."
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="Standard Webhooks signing secret (`whsec_...`); required for webhooks.",
    )
    webhook_allow_http: bool = Field(default=False, description="Allow http:// webhook URLs.")
    webhook_allow_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts, IPs or CIDRs exempt from the SSRF address checks (comma-separated).",
    )
    webhook_timeout_s: float = Field(default=10.0, gt=0, description="One delivery attempt.")
    webhook_retry_schedule_s: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [10.0, 60.0, 300.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0],
        description="Delays before each retry (comma-separated seconds); attempts = len + 1.",
    )
    webhook_retry_jitter: float = Field(
        default=0.2, ge=0, le=1, description="Each delay is shortened by up to this fraction."
    )
    webhook_retry_after_max_s: float = Field(
        default=21600.0, gt=0, description="Cap on a receiver's Retry-After."
    )
    webhook_progress_interval_s: float = Field(
        default=5.0, ge=0, description="At most one progress webhook per job this often."
    )

    # --- Image inputs (POST /v1/uploads; fetched by nodes) ---------------------------------------
    upload_max_bytes: int = Field(
        default=20 * 1024 * 1024, ge=1024, description="Largest uploaded or fetched input image."
    )
    upload_expiry_s: int = Field(
        default=900, ge=60, le=7 * 86400, description="Lifetime of an upload's presigned PUT."
    )
    input_max_pixels: int = Field(
        default=4096 * 4096, ge=64 * 64, description="Largest input image (width × height)."
    )
    input_fetch_timeout_s: float = Field(
        default=10.0, gt=0, description="A node's whole fetch of one input image URL."
    )
    input_allow_http: bool = Field(default=False, description="Allow http:// input image URLs.")
    input_allow_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts, IPs or CIDRs exempt from the SSRF address checks of input image URLs "
        "(comma-separated).",
    )
    # --- Batches (tasks/batches) --------------------------------------------------------------
    max_batch_bytes: int = Field(
        default=2 * 1024**3, ge=1024, description="Larger POST /v1/batches bodies: 413."
    )
    batch_body_timeout_s: float = Field(
        default=3600.0, gt=0, description="Time to send (and validate) a POST /v1/batches body."
    )
    batch_window: int = Field(
        default=256,
        ge=1,
        description="Cap of the feeding window: most jobs of one API key's batches queued or "
        "running at once.",
    )
    batch_window_min: int = Field(
        default=16, ge=1, description="Floor of the feeding window (also its size with no node up)."
    )
    batch_window_factor: float = Field(
        default=4.0,
        gt=0,
        description="The window is this × the live nodes' replica groups × max batch, within its "
        "floor and cap.",
    )
    batch_item_retention_s: int = Field(
        default=60,
        ge=0,
        description="A batch job's record is kept this long once its result line is written.",
    )
    batch_progress_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="At most one batch.progress event (SSE) and webhook per batch this often.",
    )
    batch_feed_interval_s: float = Field(
        default=0.5, gt=0, description="How often each node's feeder visits the active batches."
    )
    batch_feed_chunk: int = Field(
        default=500, ge=1, description="Most lines one feeder visit creates (or ends) per batch."
    )
    batch_results_flush_s: float = Field(
        default=2.0,
        ge=0,
        description="A batch's finished jobs are written as a result part at least this often.",
    )
    batch_input_retry_s: float = Field(
        default=30.0,
        ge=0,
        description="A batch whose input cannot be read this long (read again at each feeder "
        "visit) fails, with the reason in its view.",
    )

    @field_validator("webhook_secret")
    @classmethod
    def _standard_webhooks_secret(cls, value: SecretStr | None) -> SecretStr | None:
        # Refuse a malformed secret at start-up rather than at the first delivery.
        if value is None or not value.get_secret_value():
            return None
        encoded = value.get_secret_value().removeprefix("whsec_")
        try:
            decoded = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
        except binascii.Error as exc:
            raise ValueError("webhook_secret must be whsec_ followed by base64") from exc
        if len(decoded) < 16:
            raise ValueError("webhook_secret must carry at least 16 random bytes")
        return value

    @field_validator(
        "pipelines",
        "webhook_allow_hosts",
        "webhook_retry_schedule_s",
        "input_allow_hosts",
        mode="before",
    )
    @classmethod
    def _split_commas(cls, value: object) -> object:
        # Env values are plain comma lists (KILN_WEBHOOK_ALLOW_HOSTS=127.0.0.1,::1) or JSON arrays.
        return comma_or_json_list(value)
