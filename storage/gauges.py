"""Counts an API's metrics read at scrape time: one pipelined round trip each, nothing scanned.

`job_counts`: records per state, the sizes of the state indexes (finished records stay in theirs
until their retention ends and the pruner drops them). `list_lengths`: the length of each Redis
list named, e.g. Celery's queues (kombu keeps a queue's waiting messages in one list under the
app's key prefix; tasks/queue/app.py names the prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.common.states import JobState
from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary


@redis_boundary
def job_counts(store: StoreBase) -> dict[JobState, int]:
    """How many job records are in each state (ZCARD of each state index)."""
    with store.redis.pipeline(transaction=False) as pipe:
        for state in JobState:
            pipe.zcard(store.keys.state_index(state.value))
        counts = pipe.execute()
    return {state: int(count) for state, count in zip(JobState, counts, strict=True)}


@redis_boundary
def list_lengths(store: StoreBase, keys: Sequence[str]) -> list[int]:
    """LLEN of each key (0 for a key that does not exist)."""
    if not keys:
        return []
    with store.redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.llen(key)
        return [int(length) for length in pipe.execute()]
