"""Creation of jobs, single and bulk: create.lua and create_many.lua (storage/lua/)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.common.states import JobState
from kiln.storage.base import StoreBase, check_acknowledged, dumps, wait_command
from kiln.storage.boundary import redis_boundary
from kiln.storage.errors import BatchNotFound, IdempotencyConflict, StorageError
from kiln.storage.queues import QueueSnapshot, snapshot_call, snapshot_from
from kiln.storage.records import JobRecord, NewJob
from kiln.storage.scripts import ScriptCall, first_lost_script, queue_by_sha, source

# jobs per pipelined round trip in create_jobs: large enough to amortise the round trip
DEFAULT_CHUNK = 1000
# jobs per script run inside a chunk: one run holds Redis for about a millisecond, not more
_JOBS_PER_SCRIPT = 100


class QueueFull(StorageError):
    """As many jobs are queued in all as `max_depth` allows; nothing was written."""

    def __init__(self, depth: int) -> None:
        super().__init__(f"{depth} jobs are queued, the most allowed")
        self.depth = depth


def request_fingerprint(request: dict[str, Any]) -> str:
    """sha256 of the request's canonical JSON (used when NewJob.fingerprint is not given)."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Placement:
    """The queues a snapshot of a queued job's place reads, as `queue_snapshot` takes them."""

    queue: str
    other: str | None  # the other lane's queue, whose size counts
    rate_queues: Sequence[str]  # the queues whose completions make the rate


def _cap(limit: int | None) -> int | str:
    return "" if limit is None else limit


class CreationOps(StoreBase):
    """Write new jobs as `queued`: record, first event, indexes and counters in one step."""

    def _shared_keys(self) -> list[str]:
        """The KEYS[1..5] of create.lua and create_many.lua: what every new job touches."""
        k = self.keys
        return [
            k.all_index,
            k.state_index(JobState.QUEUED.value),
            k.unpublished,
            k.queue_depth,
            k.creation_seq,
            k.owner_queued,
        ]

    def _job_keys(self, new: NewJob) -> list[str]:
        """KEYS[7..13] of create.lua: the job's own keys ('' for what it has not)."""
        k, batch = self.keys, new.batch_id
        return [
            k.job(new.id),
            k.events(new.id),
            k.idempotency(new.idempotency_key) if new.idempotency_key else "",
            k.batch(batch) if batch else "",
            k.batch_index(batch) if batch else "",
            k.owner_index(new.owner) if new.owner else "",
            k.queue_index(new.queue) if new.queue else "",
        ]

    def _prefixes(self) -> list[str | int]:
        """The ARGV[2..9] of create_many.lua: it completes each job's keys from these."""
        k = self.keys
        return [
            k.job_prefix,
            k.events_suffix,
            k.idempotency_prefix,
            k.batch_prefix,
            k.batch_index_prefix,
            k.owner_index_prefix,
            k.queue_index_prefix,
            self.settings.event_stream_maxlen,
        ]

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
            new.queue or "",
            dumps(new.trace),
        ]

    @redis_boundary
    def create_job(
        self,
        new: NewJob,
        max_queued: int | None = None,
        *,
        max_depth: int | None = None,
        message: tuple[str, str] | None = None,
    ) -> tuple[JobRecord, bool]:
        """Write a `queued` record (event 1, indexes, counters); returns (record, created).

        With an idempotency key already bound to the same fingerprint, or an id that exists,
        the existing record comes back with created=False; another fingerprint raises
        IdempotencyConflict. BatchNotFound if `batch_id` names no batch. QuotaExceeded if the
        job has an owner with `max_queued` queued jobs already, QueueFull if `max_depth` jobs
        are queued in all (both checked in the same step). `message`: (Redis list, payload)
        of the job's broker message, pushed with the record when it is created, which is then
        marked published.
        """
        keys, args = self.create_call(new, max_queued, max_depth, message)
        return self.created(new, self._run_acknowledged("create", keys, args, strict=True))

    def create_call(
        self,
        new: NewJob,
        max_queued: int | None = None,
        max_depth: int | None = None,
        message: tuple[str, str] | None = None,
    ) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of create.lua for `create_job`'s arguments."""
        list_key, payload = message or ("", "")
        keys = [*self._shared_keys(), *self._job_keys(new), list_key]
        settings = [
            self.keys.job_prefix,
            self.settings.event_stream_maxlen,
            _cap(max_queued),
            _cap(max_depth),
            payload,
        ]
        fields = self._create_fields(new)  # the trace goes last: ARGV[15]
        return keys, [*fields[:-1], *settings, fields[-1]]

    def created(self, new: NewJob, reply: list[Any]) -> tuple[JobRecord, bool]:
        """(record, created) from create.lua's reply; QueueFull for its refusal."""
        status, record = reply
        if status == "FULL":
            raise QueueFull(int(record))
        return self._record(new.id, record), status == 1

    @redis_boundary
    def create_and_place(
        self,
        new: NewJob,
        *,
        max_queued: int | None = None,
        max_depth: int | None = None,
        message: tuple[str, str] | None = None,
        place: Placement | None = None,
    ) -> tuple[JobRecord, bool, QueueSnapshot | None]:
        """`create_job`, and the created job's `queue_snapshot` of `place`: one round trip.

        The snapshot is None without `place` or when no job was created (an idempotent hit is
        another job: ask `queue_snapshot` about it). `storage.async_creation` runs the same
        calls from an event loop.
        """
        calls = self.placement_calls(new, max_queued, max_depth, message, place)
        return self.placed(new, self._pipelined(calls))

    def placement_calls(
        self,
        new: NewJob,
        max_queued: int | None,
        max_depth: int | None,
        message: tuple[str, str] | None,
        place: Placement | None,
    ) -> list[ScriptCall]:
        """The scripts `create_and_place` pipelines: create.lua, then queue_snapshot.lua."""
        keys, args = self.create_call(new, max_queued, max_depth, message)
        calls: list[ScriptCall] = [("create", keys, args)]
        if place is not None:
            keys, args = snapshot_call(
                self.keys, new.id, place.queue, place.other, place.rate_queues
            )
            calls.append(("queue_snapshot", keys, args))
        return calls

    def placed(
        self, new: NewJob, replies: list[Any]
    ) -> tuple[JobRecord, bool, QueueSnapshot | None]:
        """`create_and_place`'s answer from the replies to its `placement_calls`."""
        record, created = self.created(new, replies[0])
        if len(replies) < 2 or not created:
            return record, created, None
        return record, created, snapshot_from(replies[1])

    def _pipelined(self, calls: list[ScriptCall]) -> list[Any]:
        """Run scripts in one pipeline, by sha: a script Redis lost is loaded and run again.

        (redis-py's pipelines check every script with SCRIPT EXISTS first: another round trip.)
        """
        replies = self._execute(calls, raise_on_error=False)
        rerun_from = first_lost_script(replies)
        if rerun_from is None:
            return replies
        for name in {name for name, _keys, _args in calls}:
            self.redis.script_load(source(name))
        # the ones before the lost one ran: only the rest run again (and raise as they will)
        return [*replies[:rerun_from], *self._execute(calls[rerun_from:])]

    def _execute(self, calls: list[ScriptCall], raise_on_error: bool = True) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        queue_by_sha(pipe, calls)
        wait = wait_command(self.settings)  # on the writes' own connection: see _run_acknowledged
        if wait is not None:
            pipe.execute_command(*wait)
        replies = list(pipe.execute(raise_on_error=raise_on_error))
        if wait is not None:
            check_acknowledged(self.settings, replies.pop())
        return replies

    @redis_boundary
    def create_jobs(self, news: Iterable[NewJob], chunk_size: int = DEFAULT_CHUNK) -> None:
        """Create many jobs, pipelined: one round trip per chunk of `chunk_size` jobs.

        Each job is created exactly as by create_job (existing ids and same-fingerprint keys are
        skipped). Idempotency conflicts do not stop the others: IdempotencyConflict is raised at
        the end naming the keys. BatchNotFound stops at the chunk where it happened (jobs of
        earlier chunks, and the chunk's other jobs, stay written).
        """
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
        """One create_many run per group, in one pipeline by sha (see `_pipelined`)."""
        keys, prefixes = self._shared_keys(), self._prefixes()
        calls: list[ScriptCall] = [
            ("create_many", keys, [dumps([self._create_fields(new) for new in group]), *prefixes])
            for group in groups
        ]
        return self._pipelined(calls)
