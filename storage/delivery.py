"""Delivery bookkeeping: confirmation of Celery publishes, and the webhook attempts log."""

from __future__ import annotations

import json
from typing import Any

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary

# the sweeper handles this many unconfirmed jobs per call
_SWEEP_BATCH = 1000
# attempts kept per job: enough to debug a flaky receiver, bounded for a broken one
WEBHOOK_LOG_CAP = 100


class DeliveryOps(StoreBase):
    """Publish confirmation and webhook attempts."""

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

    @redis_boundary
    def record_webhook_attempt(self, job_id: str, attempt: dict[str, Any]) -> None:
        """Append one delivery attempt to the job's log (kept as long as the record)."""
        self._require_id(job_id)
        self._run(
            "webhook_attempt",
            [self.keys.job(job_id), self.keys.webhooks(job_id)],
            [job_id, dumps(attempt), WEBHOOK_LOG_CAP],
        )

    @redis_boundary
    def webhook_attempts(self, job_id: str) -> list[dict[str, Any]]:
        """The job's webhook attempts, oldest first."""
        self._require_id(job_id)
        return [json.loads(item) for item in self.redis.lrange(self.keys.webhooks(job_id), 0, -1)]
