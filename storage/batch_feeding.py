"""The feeder's side of a fed batch: its lease, the cursor, the open set and the result parts.

One feeder at a time holds a batch's feeder lease (storage/leases.py `FeederLeaseOps`: a growing
token, like job leases).
The open set holds the fed jobs whose result is not written yet: it is bounded by the feeding
window. Every write presents the lease token; a feeder that lost its lease changes nothing.
"""

from __future__ import annotations

from enum import StrEnum

from kiln.common.states import is_final_batch
from kiln.storage.boundary import redis_boundary
from kiln.storage.keys import valid_id
from kiln.storage.leases import FeederLeaseOps


class FedWrite(StrEnum):
    """What became of a cursor move: applied, stale (lease or cursor moved on), or stopping."""

    applied = "applied"
    stale = "stale"
    stopping = "stopping"  # the batch was canceled or expired since the feeder read it


_FED_REPLIES = {1: FedWrite.applied, 0: FedWrite.stale, 2: FedWrite.stopping}


class BatchFeeding(FeederLeaseOps):
    """Fenced writes of the one feeder of each batch (its lease: storage/leases.py)."""

    def _feeder_keys(self, batch_id: str) -> list[str]:
        k = self.keys
        return [k.batch(batch_id), k.batch_feeder(batch_id), k.batch_open(batch_id)]

    @redis_boundary
    def open_items(self, batch_id: str) -> list[tuple[str, int]]:
        """The batch's fed jobs whose result is not written yet: (job id, line), by line."""
        pairs = self.redis.zrange(self.keys.batch_open(batch_id), 0, -1, withscores=True)
        return [(job_id, int(line)) for job_id, line in pairs]

    @redis_boundary
    def record_fed(
        self,
        batch_id: str,
        lease: tuple[int, str],
        read_at: int,
        cursor: tuple[int, int],
        opened: list[tuple[str, int]],
        ended: tuple[int, str, str] = (0, "", ""),
    ) -> FedWrite:
        """Move the cursor from `read_at` (as the feeder read it) to `cursor` (fenced).

        `cursor` = (items handled, byte offset of the next item); `opened` = (job id, line) of the
        jobs created (or found) for those lines; `ended` = (lines ended without a job, the reason,
        the object key of their result part): a write with lines ended is the wind-down's, any
        other one feeds new jobs and is refused (`stopping`) once the batch was asked to stop.
        Lines ended are counted as finished under their reason (`storage.counters`), as lines
        whose job ended are. Nothing is written unless `applied`.
        """
        token, owner = lease
        new_cursor, offset = cursor
        count, reason, part = ended
        mode = "end" if reason else "feed"
        keys = [
            *self._feeder_keys(batch_id),
            self.keys.batch_parts(batch_id),
            self.keys.finished_counts,
        ]
        flat: list[str | int] = []
        for job_id, line in opened:
            flat += [line, job_id]
        args = [token, owner, read_at, new_cursor, offset, count, reason, part, mode, *flat]
        return _FED_REPLIES[int(self._run("batch_fed", keys, args))]

    @redis_boundary
    def record_reported(
        self,
        batch_id: str,
        lease: tuple[int, str],
        part: str,
        job_ids: list[str],
        retention_s: int,
    ) -> bool:
        """The results of `job_ids` are stored in the object `part` (fenced); False if stale.

        Their job records then expire after `retention_s`: the results are their durable record.
        """
        token, owner = lease
        k = self.keys
        job_keys = [key for j in job_ids for key in (k.job(j), k.events(j), k.webhooks(j))]
        keys = [*self._feeder_keys(batch_id), k.batch_parts(batch_id), k.retired, *job_keys]
        args = [token, owner, part, max(0, retention_s), *job_ids]
        return bool(self._run("batch_reported", keys, args))

    @redis_boundary
    def finish_fed(
        self, batch_id: str, lease: tuple[int, str], status: str, summary_part: str
    ) -> bool:
        """End the batch with `status` and its summary part (fenced); False if not applicable."""
        if not is_final_batch(status):
            raise ValueError(f"not a final status: {status!r}")
        token, owner = lease
        keys = [
            *self._feeder_keys(batch_id),
            self.keys.batch_parts(batch_id),
            self.keys.active_batches,
            self.keys.finished_counts,
        ]
        args = [token, owner, batch_id, status, summary_part, self.settings.retention_s]
        return bool(self._run("batch_finish", keys, args))

    @redis_boundary
    def input_failed(self, batch_id: str, now: float) -> tuple[int, float]:
        """Count a failed read of the batch's input: (failures in a row, when the first was)."""
        key = self.keys.batch(batch_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hsetnx(key, "input_failed_at", repr(now))
        pipe.hincrby(key, "input_failures", 1)
        pipe.hget(key, "input_failed_at")
        _, failures, since = pipe.execute()
        return int(failures), float(since)

    @redis_boundary
    def input_read(self, batch_id: str) -> None:
        """The batch's input was read again: its failures in a row start over."""
        self.redis.hdel(self.keys.batch(batch_id), "input_failures", "input_failed_at")

    @redis_boundary
    def owner_queued(self, owner: str) -> int:
        """How many queued jobs the owner has now, as the state machine counts them."""
        return int(self.redis.hget(self.keys.owner_queued, owner) or 0)

    @redis_boundary
    def job_states(self, job_ids: list[str]) -> list[str | None]:
        """The state of each job (None where there is no record), in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id if valid_id(job_id) else "-"), "state")
        return list(pipe.execute())
