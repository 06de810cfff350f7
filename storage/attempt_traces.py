"""Where each attempt of a job left its trace: the next attempt's span links to it.

A node that starts an attempt of a job (tracing on) notes its `kiln.attempt` span's W3C context
on the job's record (field `attempt_trace`); a later attempt (a retry, a job handed back and
resumed elsewhere, a lapsed lease run again) reads it first and links its own span to it. Only
tracing nodes read or write it: with tracing off a delivery costs no round trip more.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import redis

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary

ATTEMPT_TRACE_FIELD = "attempt_trace"
# a record changed by another writer between the read and the write is read again this often
_TRIES = 3


class AttemptTraces(StoreBase):
    """The trace context of a job's newest attempt, on its record."""

    @redis_boundary
    def previous(self, job_id: str) -> dict[str, str]:
        """The context its newest attempt noted ({} for none: the first attempt, or untraced)."""
        raw = self.redis.hget(self.keys.job(job_id), ATTEMPT_TRACE_FIELD)
        found = json.loads(raw) if raw else {}
        return found if isinstance(found, dict) else {}

    @redis_boundary
    def note(self, job_id: str, carrier: Mapping[str, str]) -> bool:
        """Note this attempt's context; False when the record is gone (nothing is written).

        Written only to a record that exists (a gone job's hash is never made anew), under
        WATCH; a record that another writer changed in between is read again, a few times.
        """
        key = self.keys.job(job_id)
        for _ in range(_TRIES):
            with self.redis.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    if not pipe.exists(key):
                        return False
                    pipe.multi()
                    pipe.hset(key, ATTEMPT_TRACE_FIELD, dumps(dict(carrier)))
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
        return False
