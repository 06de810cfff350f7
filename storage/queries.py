"""Reads of the job store: records, events, listing with cursor paging, the queue counter."""

from __future__ import annotations

from kiln.common.states import JobState
from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary
from kiln.storage.index_pages import newest_first
from kiln.storage.keys import valid_id
from kiln.storage.records import JobEvent, JobRecord, event_from_entry, job_from_hash


class QueryOps(StoreBase):
    """Read-side operations of the job store."""

    @redis_boundary
    def get(self, job_id: str) -> JobRecord:
        """The job's record; JobNotFound if there is none (or it expired)."""
        self._require_id(job_id)
        return self._record(job_id, self.redis.hgetall(self.keys.job(job_id)))

    @redis_boundary
    def get_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        """Records of `job_ids` in order (None where missing), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            # an impossible id reads a key that cannot exist
            pipe.hgetall(self.keys.job(job_id if valid_id(job_id) else "-"))
        return [job_from_hash(data) if data else None for data in pipe.execute()]

    @redis_boundary
    def events(
        self, job_id: str, after_seq: int = 0, block_ms: int | None = None, count: int = 100
    ) -> list[JobEvent]:
        """Events with seq > after_seq, oldest first; waits up to block_ms for the first one.

        Entry ids are `<seq>-0`, so an SSE Last-Event-ID is directly the `after_seq`. A wait is
        capped below the socket timeout. An unknown job has no events (not an error).
        """
        self._require_id(job_id)
        if block_ms is not None:
            cap_ms = max(1, int(self.settings.redis_socket_timeout_s * 1000) - 1000)
            block_ms = cap_ms if block_ms <= 0 else min(block_ms, cap_ms)
        reply = self.redis.xread(
            {self.keys.events(job_id): f"{after_seq}-0"}, count=count, block=block_ms
        )
        if not reply:
            return []
        entries = reply[0][1] if isinstance(reply, list) else next(iter(reply.values()))[0]
        return [event_from_entry(entry_id, fields) for entry_id, fields in entries]

    @redis_boundary
    def latest_events(self, job_id: str, count: int = 32) -> list[JobEvent]:
        """The job's newest `count` events, newest first (an unknown job has none)."""
        self._require_id(job_id)
        entries = self.redis.xrevrange(self.keys.events(job_id), "+", "-", count=count)
        return [event_from_entry(entry_id, fields) for entry_id, fields in entries]

    @redis_boundary
    def queue_depth(self) -> int:
        """Jobs in `queued` (a counter the transition scripts move)."""
        return int(self.redis.get(self.keys.queue_depth) or 0)

    @redis_boundary
    def list_jobs(
        self,
        owner: str | None = None,
        state: JobState | None = None,
        batch_id: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> tuple[list[JobRecord], str | None]:
        """Jobs matching every filter given, newest first; pass the returned cursor for more.

        A page may be shorter than `limit` while a cursor is still returned (the scan per call
        is bounded); None means there is nothing more. Expired records are skipped and dropped
        from the index read.
        """
        if batch_id is not None and not valid_id(batch_id):
            return [], None
        index = self._pick_index(owner, state, batch_id)
        return newest_first(
            self.redis,
            index,
            cursor,
            limit,
            self.get_many,
            lambda record: _matches(record, owner, state, batch_id),
        )

    @redis_boundary
    def prune_indexes(self, limit: int = 1000) -> int:
        """Drop index entries of finished jobs whose records expired; returns how many were seen.

        Call it periodically (e.g. from the reaper loop); without it the indexes keep growing.
        """
        k = self.keys
        seen: int = self._run(
            "prune_indexes",
            [k.retired, k.all_index],
            [limit, k.job_prefix, k.state_index_prefix, k.owner_index_prefix, k.batch_index_prefix],
        )
        return seen

    def prune_due_indexes(self, limit: int = 1000, max_calls: int = 100) -> int:
        """`prune_indexes` until nothing more is due; returns how many entries were seen.

        One call drops at most `limit` entries, so no script holds Redis for long; a batch can
        finish thousands of lines a minute, and pruning a fixed 1,000 per pass would let the
        indexes grow with the batch instead of its window. `max_calls` bounds one pass.
        """
        total = 0
        for _ in range(max_calls):
            seen = self.prune_indexes(limit)
            total += seen
            if seen < limit:
                break
        return total

    def _pick_index(self, owner: str | None, state: JobState | None, batch_id: str | None) -> str:
        # the narrowest index drives the scan; the other filters are checked on the records
        if batch_id is not None:
            return self.keys.batch_index(batch_id)
        if owner is not None:
            return self.keys.owner_index(owner)
        if state is not None:
            return self.keys.state_index(JobState(state).value)
        return self.keys.all_index


def _matches(
    record: JobRecord, owner: str | None, state: JobState | None, batch_id: str | None
) -> bool:
    return (
        (owner is None or record.owner == owner)
        and (state is None or record.state == state)
        and (batch_id is None or record.batch_id == batch_id)
    )
