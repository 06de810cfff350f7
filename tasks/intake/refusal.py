"""What the intake answers: who asks and through which door, a typed refusal, an accepted job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.storage.job_store import NewJob
from kiln.tasks.contract.schemas import JobRequest

# where a refusal points, from the request's top (no "body", no batch line number)
Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class Caller:
    """Who submits: the API key (a job's owner; None without auth) and its own queued cap."""

    key_id: str | None = None
    max_queued: int | None = None  # None: the server's KILN_MAX_QUEUED_PER_KEY applies


@dataclass(frozen=True)
class Refusal:
    """Why a request is not a job: HTTP status, error code, the field it names, a message."""

    status: int
    code: str
    loc: Loc
    message: str
    value: Any = None
    context: dict[str, Any] = field(default_factory=dict)
    retry_after_s: int | None = None  # 429s: when to try again

    def error(self) -> dict[str, Any]:
        """The refusal as one entry of FastAPI's error list, `loc` from the request's top."""
        error: dict[str, Any] = {"type": self.code, "loc": list(self.loc), "msg": self.message}
        if self.context:
            error["ctx"] = self.context
        return error


class Refused(ValueError):
    """A refusal raised to a Python caller (the direct entrance)."""

    def __init__(self, refusal: Refusal) -> None:
        where = ".".join(str(part) for part in refusal.loc)
        super().__init__(f"{where}: {refusal.message}" if where else refusal.message)
        self.refusal = refusal


@dataclass(frozen=True)
class Accepted:
    """A request the intake took: the effective request (its seed drawn) and the job to write."""

    request: JobRequest
    new: NewJob

    @property
    def seed(self) -> int:
        """The job's seed (the caller's, else the one drawn once, here)."""
        assert self.request.seed is not None
        return self.request.seed
