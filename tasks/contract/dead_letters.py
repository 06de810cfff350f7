"""The dead-letter routes' bodies: a dead letter's view, a page of them, a redrive and its result.

docs/contract.md §5a says what a dead letter holds and what a redrive makes of it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# at most this many dead letters per redrive call, and jobs made per second at most
MAX_REDRIVE = 1000
MAX_REDRIVE_RATE = 100.0
DEFAULT_REDRIVE_RATE = 10.0
# a redrive paces its jobs within one call: it may not last longer than this
MAX_REDRIVE_SECONDS = 120.0


class AttemptView(BaseModel):
    """One run of the job: its number, node, start and end, where it went and why."""

    attempt: int
    node: str
    started_at: float
    ended_at: float | None = None
    outcome: str | None = Field(default=None, description="The state the run left the job in.")
    error: dict[str, Any] | None = None
    # its step accounting (docs/contract.md §5b), set as the run ended; null for a run that
    # ended before attempts were accounted
    steps_restored: int | None = None
    steps_reached: int | None = Field(
        default=None, description="The furthest denoising step the run reached."
    )
    steps_computed: int | None = None
    steps_recomputed: int | None = None
    seconds_lost: float | None = None
    step_s: float | None = Field(default=None, description="The run's mean seconds per step.")


class DeadLetterView(BaseModel):
    """A failed job as its dead letter keeps it (docs/contract.md §5a)."""

    id: str
    owner: str | None
    pipeline: str | None
    dead_at: float
    poison: str | None = Field(
        description="Why Kiln marked it poison (never run again by itself), or null."
    )
    error: dict[str, Any] | None
    attempts: int
    attempt_log: list[AttemptView]
    request: dict[str, Any]
    lane: str
    queue: str | None
    batch_id: str | None
    metadata: dict[str, str]
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    checkpoint: dict[str, Any] | None = Field(
        description="The job's last step checkpoint as recorded (key, sha256, size, "
        "steps_done, lease_token, attempt, written_at); null where it wrote none."
    )
    redriven_to: str | None = Field(description="The job a redrive made of it, if any.")
    redriven_at: float | None


class DeadLetterList(BaseModel):
    """One page of dead letters, newest first; pass `next_cursor` as `cursor` for the next."""

    dead_letters: list[DeadLetterView]
    next_cursor: str | None = None


class RedriveFilter(BaseModel):
    """Which dead letters to redrive (every field set must match); newest first."""

    # strict: `"poison": 0.0` or `"since": "5"` is a 422 naming the field, never read as a value
    model_config = ConfigDict(extra="forbid", strict=True)

    error_type: str | None = Field(default=None, max_length=128, description="e.g. poison")
    pipeline: str | None = Field(default=None, max_length=128)
    since: float | None = Field(default=None, ge=0, description="Died at or after (epoch s).")
    until: float | None = Field(default=None, ge=0, description="Died before (epoch s).")
    owner: str | None = Field(default=None, max_length=128, description="Admin keys only.")
    include_redriven: bool = Field(default=False, description="Also those redriven already.")
    poison: bool | None = Field(default=None, description="Only poison (true) or only not.")


class RedriveRequest(BaseModel):
    """`ids` or a `filter` (one of them), paced at `rate` jobs per second."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] | None = Field(default=None, min_length=1, max_length=MAX_REDRIVE)
    filter: RedriveFilter | None = None
    limit: int = Field(default=100, ge=1, le=MAX_REDRIVE, description="Most a filter takes.")
    dry_run: bool = Field(default=False, description="List what would be redriven; change none.")
    rate: float = Field(
        default=DEFAULT_REDRIVE_RATE,
        gt=0,
        le=MAX_REDRIVE_RATE,
        description="New jobs per second at most.",
    )

    @model_validator(mode="after")
    def _ids_or_filter(self) -> RedriveRequest:
        if (self.ids is None) == (self.filter is None):
            raise ValueError("give either ids or filter")
        return self


RedriveOutcome = Literal[
    "redriven", "would_redrive", "not_found", "forbidden", "already_redriven", "refused"
]


class RedriveItem(BaseModel):
    """What the redrive did with one dead letter."""

    id: str
    outcome: RedriveOutcome
    new_job_id: str | None = None
    message: str | None = None


class RedriveResult(BaseModel):
    """Every dead letter the redrive looked at, in order, and how many jobs it made."""

    dry_run: bool
    rate: float
    redriven: int
    results: list[RedriveItem]
