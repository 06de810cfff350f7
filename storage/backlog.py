"""The backlog as autoscaling and admission read it: queued and running jobs, recent runs.

Read from Kiln's own records (the queue indexes, completion windows, running set and job
records), never from the broker's lists, so messages a node has prefetched still count as queued.
A node that is surplus marks itself draining in one script (`claim_surplus`), so that of several
idle nodes asking at once only as many as are surplus drain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kiln.storage.base import COMPLETION_WINDOW_S, StoreBase, dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.keys import valid_queue


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
    holders: frozenset[str]  # node ids (not lease owners) holding those running jobs' leases


@dataclass(frozen=True)
class BacklogReading:
    """Every queue asked about, read at one instant `now` (the Redis clock, s)."""

    now: float
    queues: dict[str, QueueBacklog]


# a shared view outlives its interval a few times: the other nodes keep reading the last one
# while the node that claimed it computes the next (or if that node dies first)
VIEW_LIFETIME_INTERVALS = 3


@dataclass(frozen=True)
class SharedView:
    """A view of the cluster computed by one node for all (`BacklogOps.shared_views`)."""

    value: dict[str, Any] | None  # None: none computed yet, or it expired
    due: bool  # no node has claimed its computation within the interval: one should now


class BacklogOps(StoreBase):
    """Read the backlog of queues; let an idle, surplus node mark itself draining; share views."""

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

    # Views of the cluster that one node computes per interval and every node reads: what each
    # node would otherwise read for itself every tick (every node's heartbeat, every running
    # job) costs the cluster its node count squared; computed once per interval and shared, it
    # costs one such read per interval and one small read per node and tick.

    @redis_boundary
    def shared_views(self, names: Sequence[str]) -> dict[str, SharedView]:
        """Each view and whether it is due for computing again: one round trip."""
        k = self.keys
        flat = self.redis.mget(
            [key for n in names for key in (k.shared_view(n), k.shared_view_claim(n))]
        )
        return {
            name: SharedView(json.loads(value) if value else None, claim is None)
            for name, value, claim in zip(names, flat[0::2], flat[1::2], strict=True)
        }

    @redis_boundary
    def claim_shared_view(self, name: str, node_id: str, interval_s: float) -> bool:
        """True for one caller per `interval_s`: that caller computes the view and writes it."""
        ttl_ms = max(1, int(interval_s * 1000))
        return bool(self.redis.set(self.keys.shared_view_claim(name), node_id, nx=True, px=ttl_ms))

    @redis_boundary
    def write_shared_view(self, name: str, value: dict[str, Any], ttl_s: float) -> None:
        """Store the view for every node, for `ttl_s` (a few intervals: readers keep the last)."""
        self.redis.set(self.keys.shared_view(name), dumps(value), px=max(1, int(ttl_s * 1000)))

    def shared_view(
        self, name: str, owner: str, interval_s: float, compute: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """The view `name` as the cluster last computed it; computed here when it is due.

        One caller per `interval_s` (the one whose claim succeeds) runs `compute` and shares its
        result; the others read it: one small read each. A caller finding no view at all (the
        first, or every holder gone) computes one for itself meanwhile.
        """
        view = self.shared_views([name])[name]
        claimed = view.due and self.claim_shared_view(name, owner, interval_s)
        if view.value is not None and not claimed:
            return view.value
        value = compute()
        if claimed:
            self.write_shared_view(name, value, VIEW_LIFETIME_INTERVALS * interval_s)
        return value


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
