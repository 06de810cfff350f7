"""The webhook attempt log: each delivery attempt of a job's webhooks, kept beside its record."""

from __future__ import annotations

import json
from typing import Any

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary

# attempts kept per job: enough to debug a flaky receiver, bounded for a broken one
WEBHOOK_LOG_CAP = 100


class WebhookAttemptOps(StoreBase):
    """Append to and read a job's webhook attempt log."""

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
