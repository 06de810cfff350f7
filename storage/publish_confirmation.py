"""Confirmation of Celery publishes: which queued jobs' messages are known to be on the broker."""

from __future__ import annotations

from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary

# the sweeper handles this many unconfirmed jobs per call
_SWEEP_BATCH = 1000


class PublishConfirmationOps(StoreBase):
    """Mark a job's message published; find the queued jobs whose publish was never confirmed."""

    @redis_boundary
    def mark_published(self, job_id: str) -> None:
        """Record that the job's Celery message was published (the sweeper skips it)."""
        self._require_id(job_id)
        self._run("mark_published", [self.keys.job(job_id), self.keys.unpublished], [job_id])

    @redis_boundary
    def unpublished_jobs(self, older_than_s: float) -> list[str]:
        """Queued jobs whose publish was not confirmed for longer than `older_than_s`."""
        ids: list[str] = self._run(
            "unpublished",
            [self.keys.unpublished],
            [older_than_s, _SWEEP_BATCH, self.keys.job_prefix],
        )
        return ids
