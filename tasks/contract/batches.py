"""Batches (docs/contract.md §9): the rules of a batch file and what Kiln shows of a batch.

A batch is a JSONL file, one job request per line plus a `custom_id` (unique in the file, safe in
keys and paths). Kiln keeps the file in the object store and feeds its lines as capacity frees up;
each finished line becomes one result line (`BatchResult`), and a finished batch's results end
with one `BatchSummary`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.common.defaults import BATCH_LANE
from kiln.common.request import Lane
from kiln.common.states import BatchStatus
from kiln.tasks.contract.schemas import WebhookSpec
from kiln.tasks.contract.views import ErrorView, OutputView

BATCHES_PATH = "/v1/batches"
CUSTOM_ID_MAX = 64
# letters, digits, `_` and `-`, starting with a letter or digit: safe in Redis keys and object keys
CUSTOM_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,63}$"
_CUSTOM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")
DEFAULT_COMPLETION_WINDOW = "24h"
MIN_COMPLETION_WINDOW_S = 60
MAX_COMPLETION_WINDOW_S = 30 * 24 * 3600
_WINDOW = re.compile(r"([0-9]{1,9})([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# the status of a result line whose input line was refused (skip_invalid)
INVALID = "invalid"


# A line in OpenAI's Batch form: the request is `body`, `method` and `url` name Kiln's one endpoint.
OPENAI_LINE_KEYS = ("custom_id", "method", "url", "body")
OPENAI_METHOD = "POST"
OPENAI_URL = "/v1/jobs"
OPENAI_LINE_SHAPE = (
    f'{{"custom_id": "...", "method": "{OPENAI_METHOD}", "url": "{OPENAI_URL}", '
    '"body": {<job request>}}'
)
_SHOWN_CHARS = 40  # of a wrong value, in the refusal


class LineShapeError(ValueError):
    """A line in OpenAI's Batch form that does not ask for `POST /v1/jobs` with a request body."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{message}; expected {OPENAI_LINE_SHAPE}")
        self.field = field


def in_openai_form(line: dict[str, Any]) -> bool:
    """Whether a parsed batch line is in OpenAI's Batch form (`method`, `url`, `body`)."""
    # a job request has none of these fields: any of them means the line is meant as that form
    return any(key in line for key in OPENAI_LINE_KEYS[1:])


def openai_line_request(line: dict[str, Any]) -> dict[str, Any]:
    """The job request of a line in OpenAI's Batch form (its `body`); else LineShapeError.

    `method` must be POST and `url` /v1/jobs: Kiln's batch runs jobs only, so a line meant for
    another endpoint is refused rather than run as a job. `custom_id` is read as for any line.
    """
    extra = [key for key in line if key not in OPENAI_LINE_KEYS]
    if extra:
        raise LineShapeError(extra[0], f"{_shown(extra[0])} is not a key of a line in this form")
    for key, expected in (("method", OPENAI_METHOD), ("url", OPENAI_URL)):
        if line.get(key) != expected:
            raise LineShapeError(key, f"{key} must be {expected!r}; got {_shown(line.get(key))}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineShapeError("body", f"body must be the job request object; got {_shown(body)}")
    return dict(body)


def _shown(value: object) -> str:
    text = "nothing" if value is None else repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 1] + "…"


def valid_custom_id(value: object) -> bool:
    """Whether `value` may be a custom_id."""
    return isinstance(value, str) and bool(_CUSTOM_ID.fullmatch(value))


def parse_completion_window(text: str) -> int:
    """Seconds of a completion window such as `24h`, `90m`, `3600s`, `2d` or `3600`."""
    match = _WINDOW.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"completion_window {text!r} is not <number>[s|m|h|d]")
    seconds = int(match[1]) * _UNIT_S[match[2]]
    if not MIN_COMPLETION_WINDOW_S <= seconds <= MAX_COMPLETION_WINDOW_S:
        raise ValueError(
            f"completion_window must lie between {MIN_COMPLETION_WINDOW_S} s and "
            f"{MAX_COMPLETION_WINDOW_S // 86400} days; got {text!r}"
        )
    return seconds


# how a finished batch went: every line succeeded, some did, or none did
BatchOutcome = Literal["succeeded", "partial", "failed"]


class BatchEvent(StrEnum):
    """Batch events (SSE event names and webhook types); the last four end a batch's stream."""

    progress = "batch.progress"
    completed = "batch.completed"
    failed = "batch.failed"
    expired = "batch.expired"
    canceled = "batch.canceled"


def batch_event_of(status: str, outcome: str | None) -> BatchEvent:
    """The event a batch in `status` reports: `batch.failed` is `completed` with outcome failed.

    A batch still going is `batch.progress`; a finished one is named by its status, except that a
    completed batch none of whose lines succeeded is `batch.failed` (never a silent success).
    """
    if status == BatchStatus.completed:
        return BatchEvent.failed if outcome == "failed" else BatchEvent.completed
    if status == BatchStatus.canceled:
        return BatchEvent.canceled
    if status == BatchStatus.expired:
        return BatchEvent.expired
    if status == BatchStatus.failed:
        return BatchEvent.failed
    return BatchEvent.progress


class RetryInclude(StrEnum):
    """Which finished lines `POST /v1/batches/{id}/retry` runs again (all of them by default).

    Every line that ended without succeeding; not `invalid` ones, which never ran and would be
    refused again as they are.
    """

    failed = "failed"
    expired = "expired"
    canceled = "canceled"


# what a retry runs again when it names no status: every line that ended without succeeding
DEFAULT_RETRY_INCLUDE = ",".join(RetryInclude)


class BatchCounts(BaseModel):
    """Lines of a batch by where they are; they add up to `total`."""

    total: int = Field(description="Lines of the file (blank lines not counted).")
    pending: int = Field(description="Valid lines not fed yet.")
    queued: int
    running: int
    paused: int = Field(default=0, description="Lines paused (docs/contract.md §4a).")
    succeeded: int
    failed: int
    canceled: int
    expired: int
    invalid: int = Field(description="Lines refused at submit (only with skip_invalid).")


class BatchView(BaseModel):
    """A batch as the API shows it (`GET /v1/batches/{id}`)."""

    id: str
    status: BatchStatus
    outcome: BatchOutcome | None = Field(
        default=None,
        description="Once finished: succeeded (every line), partial, or failed (no line "
        "succeeded: a batch whose every item failed is `completed` with outcome `failed`).",
    )
    counts: BatchCounts
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    expires_at: float = Field(description="End of the completion window.")
    completion_window_s: int
    cancel_requested: bool = False
    error: str | None = Field(
        default=None,
        description="Why the batch could not go on (its input could not be read); else null.",
    )
    throughput_per_s: float | None = Field(
        default=None, description="Lines finished per second since the batch started."
    )
    eta_s: float | None = Field(default=None, description="Seconds left at that throughput.")
    results_written: int = Field(description="Result lines written so far (invalid included).")
    pipeline: str | None = Field(default=None, description="Default pipeline of the lines.")
    priority: Lane = BATCH_LANE
    metadata: dict[str, str] = Field(default_factory=dict)
    webhook: WebhookSpec | None = None
    parent_id: str | None = Field(default=None, description="The batch this one retries.")
    retries: list[str] = Field(
        default_factory=list, description="Ids of the batches that retry this one, oldest first."
    )


class BatchFromUpload(BaseModel):
    """`POST /v1/batches` with a JSON body: an uploaded batch file and the batch's options.

    The upload comes from `POST /v1/uploads` (purpose `batch`); the options are the query
    parameters a JSONL body would carry.
    """

    model_config = ConfigDict(extra="forbid")

    input_upload: str = Field(
        min_length=1, max_length=64, description="The upload's id (or `upload:<id>`)."
    )
    pipeline: str | None = Field(default=None, max_length=128)
    priority: Lane = BATCH_LANE
    completion_window: str = Field(default=DEFAULT_COMPLETION_WINDOW, max_length=16)
    skip_invalid: bool = False
    metadata: dict[str, str] | None = None
    webhook_url: str | None = Field(default=None, max_length=2048)
    webhook_events: list[str] | None = Field(default=None, max_length=8)


class BatchList(BaseModel):
    """One page of batches, newest first; pass `next_cursor` as `cursor` for the next page."""

    batches: list[BatchView]
    next_cursor: str | None = None


class BatchResult(BaseModel):
    """One line of a batch's results: what became of one input line."""

    type: Literal["result"] = "result"
    line: int = Field(description="The input line (1-based).")
    custom_id: str | None = None
    job_id: str | None = None
    status: str = Field(description="succeeded, failed, canceled, expired or invalid.")
    outputs: list[OutputView] = Field(default_factory=list)
    error: ErrorView | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)


class BatchSummary(BaseModel):
    """The last line of a finished batch's results."""

    type: Literal["summary"] = "summary"
    batch: BatchView
