"""The reads of the queued-jobs audit (tasks/control/audit.py), each one bounded page of its key.

The audit finds queued jobs whose Celery message is gone: in no queue list, not unacknowledged,
held by no node. It reads each place a message can be in pages (`AUDIT_PAGE` entries a call, never
one huge reply), and when each old job entered `queued`: the time of its newest event (the
`queued` event it entered with; a later event only makes it look younger, which delays it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary
from kiln.storage.queues import _check_queue

# entries read per call from a list, a hash scan or a queue index
AUDIT_PAGE = 1000


@dataclass(frozen=True)
class AuditClaim:
    """The queues a node claimed to audit, and the deadline of the latest node lapse.

    A node that lapsed may have died holding a message kombu had popped but not yet recorded:
    a job that entered its queue before that deadline is a suspect at once, not only after the
    audit age (tasks/control/audit.py `lost_jobs`). `lapse_deadline_s` is 0 when no node lapsed.
    """

    queues: list[str]
    lapse_deadline_s: float


class AuditOps(StoreBase):
    """Paged reads of queue lists, kombu's unacked hash, queue indexes and held lists."""

    @redis_boundary
    def claim_audits(self, queues: Sequence[str], interval_s: float) -> AuditClaim:
        """Those of `queues` due for an audit, now claimed by the caller.

        Due: no node claimed it within `interval_s`, or since the latest node lapse was claimed.
        """
        for queue in queues:
            _check_queue(queue)
        interval_ms = max(0, int(interval_s * 1000))
        keys = [self.keys.queued_audits, self.keys.last_lapse]
        lapse_ms, *claimed = self._run("audit_claim", keys, [interval_ms, *queues])
        return AuditClaim([str(queue) for queue in claimed], int(lapse_ms) / 1000)

    @redis_boundary
    def queued_page(self, queue: str, after_score: float | None) -> list[tuple[str, float]]:
        """Up to `AUDIT_PAGE` jobs of `queue`'s index after `after_score`, in queue order.

        Paged by score (each job's own number, unique): a job leaving the index meanwhile shifts
        no other one out of a page, as paging by rank would.
        """
        _check_queue(queue)
        low = "-inf" if after_score is None else f"({after_score}"
        page: list[tuple[str, float]] = self.redis.zrangebyscore(
            self.keys.queue_index(queue), low, "+inf", start=0, num=AUDIT_PAGE, withscores=True
        )
        return page

    @redis_boundary
    def queued_since(self, job_ids: Sequence[str]) -> dict[str, float]:
        """When each of `job_ids` entered its state (its newest event's time, s; one pipeline).

        A job without events (its record gone) is left out.
        """
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(self.keys.events(job_id), count=1)
            replies = pipe.execute()
        return {
            job_id: float(newest[0][1]["time"])
            for job_id, newest in zip(job_ids, replies, strict=True)
            if newest
        }

    @redis_boundary
    def list_page(self, key: str, start: int) -> list[str]:
        """Up to `AUDIT_PAGE` entries of the list `key` from index `start`."""
        page: list[str] = self.redis.lrange(key, start, start + AUDIT_PAGE - 1)
        return page

    @redis_boundary
    def hash_page(self, key: str, cursor: int) -> tuple[int, list[str]]:
        """One HSCAN step of the hash `key` (about `AUDIT_PAGE` fields): next cursor, values."""
        cursor, fields = self.redis.hscan(key, cursor, count=AUDIT_PAGE)
        return int(cursor), list(fields.values())

    @redis_boundary
    def held_jobs(self) -> set[str]:
        """Every job id a node listed as held, live or lapsed and not yet claimed by a sweeper."""
        return {str(job_id) for job_id in self._run("held_jobs", [self.keys.held_deliveries], [])}

    @redis_boundary
    def leased(self, job_ids: Sequence[str]) -> set[str]:
        """Those of `job_ids` whose lease is held (one pipeline)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(self.keys.lease(job_id))
            held = pipe.execute()
        return {job_id for job_id, exists in zip(job_ids, held, strict=True) if exists}
