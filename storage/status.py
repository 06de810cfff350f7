"""The job store: job and batch records, the state machine, leases, events and counters in Redis.

Key names live in storage/keys.py, the scripts in storage/lua*.py; this module assembles the
store from its parts and owns creation (single and bulk).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import redis

from storage.base import StoreBase, dumps, redis_client
from storage.batches import BatchOps
from storage.boundary import redis_boundary, translate
from storage.delivery import DeliveryOps
from storage.errors import BatchNotFound, IdempotencyConflict
from storage.keys import EVENTS_SUFFIX
from storage.leases import LeaseOps
from storage.nodes import NodeOps
from storage.queries import QueryOps
from storage.records import BatchRecord, JobEvent, JobRecord, NewJob
from storage.settings import StorageSettings
from storage.states import TERMINAL_STATES, TRANSITIONS, JobState
from storage.transitions import TransitionOps

__all__ = [
    "TERMINAL_STATES",
    "TRANSITIONS",
    "BatchRecord",
    "JobEvent",
    "JobRecord",
    "JobState",
    "JobStore",
    "NewJob",
]

# jobs per pipelined round trip in create_jobs: large enough to amortise the round trip
DEFAULT_CHUNK = 1000
# jobs per script run inside a chunk: one run holds Redis for about a millisecond, not more
_JOBS_PER_SCRIPT = 100


def request_fingerprint(request: dict[str, Any]) -> str:
    """sha256 of the request's canonical JSON (used when NewJob.fingerprint is not given)."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class JobStore(TransitionOps, LeaseOps, QueryOps, BatchOps, DeliveryOps, NodeOps, StoreBase):
    """Every Redis read and write of Kiln's job state goes through here."""

    @classmethod
    def from_settings(cls, settings: StorageSettings) -> JobStore:
        """A store with its own client for `settings.redis_url`."""
        return cls(redis_client(settings), settings)

    def _create_fields(self, new: NewJob) -> list[str]:
        fingerprint = ""
        if new.idempotency_key:
            fingerprint = new.fingerprint or request_fingerprint(new.request)
        return [
            new.id,
            dumps(new.request),
            new.lane,
            new.owner or "",
            new.batch_id or "",
            dumps(new.metadata),
            new.idempotency_key or "",
            fingerprint,
        ]

    @redis_boundary
    def create_job(self, new: NewJob) -> tuple[JobRecord, bool]:
        """Write a `queued` record (event 1, indexes, counters); returns (record, created).

        With an idempotency key already bound to the same fingerprint, or an id that exists,
        the existing record comes back with created=False; another fingerprint raises
        IdempotencyConflict. BatchNotFound if `batch_id` names no batch.
        """
        fields = self._create_fields(new)
        status, record = self._call("create", new.id, *fields[1:])
        return self._record(new.id, record), status == 1

    @redis_boundary
    def create_jobs(self, news: Iterable[NewJob], chunk_size: int = DEFAULT_CHUNK) -> None:
        """Create many jobs, pipelined: one round trip per chunk of `chunk_size` jobs.

        Each job is created exactly as by create_job (existing ids and same-fingerprint keys are
        skipped). Idempotency conflicts do not stop the others: IdempotencyConflict is raised at
        the end naming the keys. BatchNotFound stops at the chunk where it happened (jobs of
        earlier chunks, and the chunk's other jobs, stay written).
        """
        self._load_script("create_many")
        conflicts: list[str] = []
        chunk: list[NewJob] = []
        for new in news:
            chunk.append(new)
            if len(chunk) >= chunk_size:
                conflicts += self._create_chunk(chunk)
                chunk = []
        if chunk:
            conflicts += self._create_chunk(chunk)
        if conflicts:
            raise IdempotencyConflict(f"idempotency keys bound to other requests: {conflicts}")

    def _create_chunk(self, chunk: Sequence[NewJob]) -> list[str]:
        groups = [chunk[i : i + _JOBS_PER_SCRIPT] for i in range(0, len(chunk), _JOBS_PER_SCRIPT)]
        results = self._run_groups(groups)
        conflicts, missing_batch = [], None
        for group, statuses in zip(groups, results, strict=True):
            for new, status in zip(group, statuses, strict=True):
                if status == "CONFLICT":
                    conflicts.append(new.idempotency_key or "")
                elif status == "NOBATCH":
                    missing_batch = new.batch_id
        if missing_batch is not None:
            raise BatchNotFound(missing_batch)
        return conflicts

    def _run_groups(self, groups: list[Sequence[NewJob]]) -> list[list[Any]]:
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            for group in groups:
                rows = dumps([self._create_fields(new) for new in group])
                self._queue_job_script(pipe, "create_many", "", EVENTS_SUFFIX, rows)
            results = pipe.execute(raise_on_error=False)
            failure = next((r for r in results if isinstance(r, Exception)), None)
            if failure is None:
                return results
            if not isinstance(failure, redis.exceptions.RedisError):
                raise failure
            if not isinstance(failure, redis.exceptions.NoScriptError) or attempt:
                raise translate(failure) from failure
            # Redis lost its script cache (restart, SCRIPT FLUSH): reload, redo the chunk;
            # creation is idempotent per job, so the jobs that did get written are skipped
            self._load_script("create_many")
        raise AssertionError("unreachable")
