"""The backlog as autoscaling and admission read it: queued and running jobs, recent runs.

Read from Kiln's own records (the queue indexes, completion windows, running set and job
records), never from the broker's lists, so messages a node has prefetched still count as queued.
A node that is surplus marks itself draining in one script (`claim_surplus`), so that of several
idle nodes asking at once only as many as are surplus drain.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.keys import valid_queue
from kiln.storage.transitions import COMPLETION_WINDOW_S


@dataclass(frozen=True)
class QueueBacklog:
    """One queue at the instant of a `backlog` read."""

    queued: int  # jobs in the queue's index (state queued)
    paused: bool
    finished: int  # runs that ended within the completion window
    timed: int  # those of them whose start is known
    run_s: float  # their total run time (finish - start), seconds
    earliest_start: float | None  # earliest start (s) of the finished runs
    running: int  # running jobs of this queue
    holders: frozenset[str]  # node ids holding those running jobs' leases

    def mean_run_s(self) -> float | None:
        """Mean run time of the runs that ended lately; None before any did."""
        return self.run_s / self.timed if self.timed else None


@dataclass(frozen=True)
class BacklogReading:
    """Every queue asked about, read at one instant `now` (the Redis clock, s)."""

    now: float
    queues: dict[str, QueueBacklog]


class BacklogOps(StoreBase):
    """Read the backlog of queues; let an idle, surplus node mark itself draining."""

    @redis_boundary
    def backlog(self, queues: Sequence[str]) -> BacklogReading:
        """Queued, paused, recently finished and running jobs of each of `queues` (one call)."""
        for queue in queues:
            if not valid_queue(queue):
                raise ValueError(f"invalid queue name {queue!r}")
        keys = [self.keys.running, self.keys.paused_queues]
        for queue in queues:
            keys += [self.keys.queue_index(queue), self.keys.completions(queue)]
        args = [self.keys.job_prefix, COMPLETION_WINDOW_S, *queues]
        now_ms, *entries = self._run("backlog", keys, args)
        read = {queue: _queue_backlog(entry) for queue, entry in zip(queues, entries, strict=True)}
        return BacklogReading(now=int(now_ms) / 1000.0, queues=read)

    @redis_boundary
    def idempotency_bound(self, key: str) -> bool:
        """Whether an idempotency key names a job already (admission lets its replay through)."""
        return bool(self.redis.exists(self.keys.idempotency(key)))

    @redis_boundary
    def claim_surplus(self, node_id: str, desired: Mapping[str, int], by: str) -> bool:
        """If `node_id` is surplus for every pipeline in `desired`, write its drain request.

        Surplus: the live, not draining nodes serving each pipeline outnumber its desired
        count. The request asks the node to exit once idle (storage/queues.py `DrainRequest`).
        Call it only from an idle node: a node running a job never picks itself.
        """
        request = dumps({"exit": True, "requested_at": self.redis_now(), "by": by})
        args: list[object] = [self.keys.node_prefix, node_id, request]
        for pipeline, count in desired.items():
            args += [pipeline, int(count)]
        keys = [self.keys.nodes, self.keys.drain_requests]
        return bool(self._run("surplus_claim", keys, args))


def _queue_backlog(entry: list[object]) -> QueueBacklog:
    queued, paused, finished, timed, run_ms, earliest_ms, running, *holders = entry
    return QueueBacklog(
        queued=int(str(queued)),
        paused=bool(int(str(paused))),
        finished=int(str(finished)),
        timed=int(str(timed)),
        run_s=int(str(run_ms)) / 1000.0,
        earliest_start=int(str(earliest_ms)) / 1000.0 if int(str(earliest_ms)) else None,
        running=int(str(running)),
        holders=frozenset(str(h) for h in holders),
    )
