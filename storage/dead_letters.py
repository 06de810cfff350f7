"""Dead letters: jobs that ended `failed`, kept with everything needed to judge and redrive them.

The failing transition writes the dead letter in the same script (storage/lua/transition.lua with
_dead_letters.lua), so every failed job is recorded exactly once: a job fails once, and a record
already there is kept. A dead letter copies the job's request, owner, lane, queue, metadata, final
error, metrics and `attempt_log` (each run: number, node, start, end, the state it went to and
its error), plus `checkpoint` (the newest entry of the record's `checkpoints`, or null). It lives
`dead_letter_retention_s` (its job record only `retention_s`), and the set holds at most
`dead_letter_max` of them: past the cap the oldest go, in the step that adds one.

A redrive makes a new job of a dead letter (tasks/intake/redrive.py); `claim` marks the dead letter
with that job's id first, once, so two redrives of one dead letter never make two jobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary
from kiln.storage.index_pages import newest_first
from kiln.storage.keys import valid_id

# the error type of a job Kiln marked poison (docs/contract.md §5): it is never run again
POISON = "poison"


@dataclass(frozen=True)
class DeadLetter:
    """One failed job as its dead letter holds it; times are epoch seconds (Redis clock)."""

    id: str
    dead_at: float
    request: dict[str, Any]
    lane: str
    owner: str | None
    queue: str | None
    batch_id: str | None
    metadata: dict[str, str]
    created_at: float | None
    started_at: float | None
    finished_at: float | None
    attempts: int
    error: dict[str, Any] | None
    metrics: dict[str, Any]
    attempt_log: list[dict[str, Any]]
    checkpoint: dict[str, Any] | None
    redriven_to: str | None
    redriven_at: float | None

    @property
    def pipeline(self) -> str | None:
        """The pipeline its request names."""
        name = self.request.get("pipeline")
        return str(name) if name is not None else None

    @property
    def poison(self) -> str | None:
        """Why Kiln marked the job poison (its error's `poison`), or None."""
        reason = None if self.error is None else self.error.get(POISON)
        return str(reason) if reason else None

    @property
    def error_type(self) -> str | None:
        """Its final error's type (`poison`, `OutOfMemory`, `max_attempts_exceeded`, ...)."""
        return None if self.error is None else str(self.error.get("type"))


def _float(value: str | None) -> float | None:
    return float(value) if value else None


def _json(value: str | None, default: Any) -> Any:
    if not value:
        return default
    decoded = json.loads(value)
    # Lua's cjson writes an empty list as {}: a list field read as {} is empty
    if isinstance(default, list) and decoded == {}:
        return []
    return decoded


def dead_letter_from_hash(data: dict[str, str]) -> DeadLetter:
    """A DeadLetter from its hash (fields the job record lacked are absent)."""
    return DeadLetter(
        id=data["id"],
        dead_at=float(data["dead_at"]),
        request=_json(data.get("request"), {}),
        lane=data.get("lane", ""),
        owner=data.get("owner") or None,
        queue=data.get("queue") or None,
        batch_id=data.get("batch_id") or None,
        metadata=_json(data.get("metadata"), {}),
        created_at=_float(data.get("created_at")),
        started_at=_float(data.get("started_at")),
        finished_at=_float(data.get("finished_at")),
        attempts=int(data.get("attempts") or 0),
        error=_json(data.get("error"), None),
        metrics=_json(data.get("metrics"), {}),
        attempt_log=[_attempt(entry) for entry in _json(data.get("attempt_log"), [])],
        checkpoint=_json(data.get("checkpoint"), None),
        redriven_to=data.get("redriven_to") or None,
        redriven_at=_float(data.get("redriven_at")),
    )


def _attempt(entry: dict[str, Any]) -> dict[str, Any]:
    """One attempt of the log with its times as numbers (Lua keeps them as the record's text)."""
    out = dict(entry)
    for name in ("started_at", "ended_at"):
        if isinstance(out.get(name), str):
            out[name] = float(out[name])
    out.setdefault("ended_at", None)
    out.setdefault("outcome", None)
    out.setdefault("error", None)
    return out


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters a redrive by filter takes (every condition set must hold)."""

    error_type: str | None = None
    pipeline: str | None = None
    since: float | None = None  # died at or after (epoch s)
    until: float | None = None  # died before (epoch s)
    include_redriven: bool = False
    poison: bool | None = None  # marked poison (True) or not (False)

    def takes(self, letter: DeadLetter) -> bool:
        """Whether `letter` passes."""
        return (
            (self.error_type is None or letter.error_type == self.error_type)
            and (self.pipeline is None or letter.pipeline == self.pipeline)
            and (self.since is None or letter.dead_at >= self.since)
            and (self.until is None or letter.dead_at < self.until)
            and (self.include_redriven or letter.redriven_to is None)
            and (self.poison is None or (letter.poison is not None) == self.poison)
        )


class DeadLetterStore(StoreBase):
    """Reads of the dead-letter set, and the redrive's claim on one dead letter."""

    def _index(self, owner: str | None) -> str:
        k = self.keys
        return k.dead_letter_index if owner is None else k.dead_letter_owner_index(owner)

    @redis_boundary
    def get(self, job_id: str) -> DeadLetter | None:
        """The job's dead letter; None if it has none (never failed, dropped or expired)."""
        if not valid_id(job_id):
            return None
        data = self.redis.hgetall(self.keys.dead_letter(job_id))
        return dead_letter_from_hash(data) if data else None

    @redis_boundary
    def get_many(self, job_ids: Sequence[str]) -> list[DeadLetter | None]:
        """Dead letters of `job_ids` in order (None where there is none), one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.keys.dead_letter(job_id if valid_id(job_id) else "-"))
        return [dead_letter_from_hash(data) if data else None for data in pipe.execute()]

    @redis_boundary
    def page(
        self,
        owner: str | None,
        cursor: str | None,
        limit: int,
        keep: Callable[[DeadLetter], bool] = lambda _letter: True,
    ) -> tuple[list[DeadLetter], str | None]:
        """Dead letters newest first (an owner's, or all), paged as job listings are.

        ValueError for a malformed cursor. Index entries whose dead letter expired are dropped.
        """
        return newest_first(self.redis, self._index(owner), cursor, limit, self.get_many, keep)

    @redis_boundary
    def attempt_log(self, job_id: str) -> list[dict[str, Any]]:
        """The live job's attempts so far (its record's `attempt_log`), oldest first."""
        if not valid_id(job_id):
            return []
        text = self.redis.hget(self.keys.job(job_id), "attempt_log")
        return [_attempt(entry) for entry in _json(text, [])]

    @redis_boundary
    def count(self, owner: str | None = None) -> int:
        """Index entries (an owner's, or all): the dead letters, and any expired not yet read."""
        return int(self.redis.zcard(self._index(owner)))

    @redis_boundary
    def claim(self, job_id: str, new_job_id: str) -> bool:
        """Mark the dead letter redriven to `new_job_id`; False if gone or redriven already."""
        if not valid_id(job_id):
            return False
        at = f"{self.redis_now():.6f}"
        key = self.keys.dead_letter(job_id)
        return bool(self._run("dead_letter_claim", [key], [new_job_id, at]))

    @redis_boundary
    def unclaim(self, job_id: str, new_job_id: str) -> None:
        """Undo `claim` when its new job could not be made (nothing else wrote it meanwhile)."""
        key = self.keys.dead_letter(job_id)
        if self.redis.hget(key, "redriven_to") == new_job_id:
            self.redis.hdel(key, "redriven_to", "redriven_at")
