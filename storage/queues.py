"""Queues as operators and producers see them: order, recent completions, pauses, drain requests.

A queue is named `<lane>.<pipeline>` by tasks; here it is an opaque name. The state machine keeps a
queue index per queue (the queued jobs in queue order) and a completion window per queue (its runs
that ended lately); pauses and drain requests are flags an operator writes and nodes poll.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kiln.storage.base import COMPLETION_WINDOW_S, StoreBase, dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.keys import Keys, valid_queue

MAX_NODE_ID = 256


@dataclass(frozen=True)
class QueueSnapshot:
    """Where a queued job stands, and its queues' recent completions, read at one instant."""

    rank: int | None  # queued jobs ahead of it in its queue; None: not queued there
    other_size: int  # jobs queued in the other queue asked about
    paused: bool  # its queue is paused
    other_paused: bool
    finished: int  # runs finished within the window, in the queues asked about
    earliest_start: float | None  # earliest start (s) of those runs
    now: float  # the Redis clock (s)

    def completion_rate(self) -> float | None:
        """Runs finished per second lately; None before any finished within the window.

        Counted from the start of the earliest run that finished, so one run that just ended
        after a minute is a rate of one a minute, not one a moment.
        """
        if not self.finished:
            return None
        since = self.earliest_start if self.earliest_start else self.now - COMPLETION_WINDOW_S
        return self.finished / max(self.now - since, 1.0)


@dataclass(frozen=True)
class DrainRequest:
    """An operator's request that a node finish its jobs and take no more."""

    node_id: str
    exit: bool  # exit once idle; else stay up, idle, until the request is withdrawn
    requested_at: float
    by: str = ""


def _check_queue(queue: str) -> None:
    if not valid_queue(queue):
        raise ValueError(f"invalid queue name {queue!r}")


def snapshot_call(
    keys: Keys, job_id: str, queue: str, other: str | None, rate_queues: Sequence[str]
) -> tuple[list[str], list[Any]]:
    """The KEYS and ARGV of queue_snapshot.lua (also pipelined by CreationOps.create_and_place)."""
    script_keys = [
        keys.paused_queues,
        keys.queue_index(queue),
        keys.queue_index(other) if other else "",
        *(keys.completions(q) for q in rate_queues),
    ]
    return script_keys, [job_id, queue, other or "", COMPLETION_WINDOW_S]


def snapshot_from(reply: list[Any]) -> QueueSnapshot:
    """queue_snapshot.lua's reply as a QueueSnapshot."""
    rank, other_size, paused, other_paused, finished, earliest, now_ms = map(int, reply)
    return QueueSnapshot(
        rank=rank if rank >= 0 else None,
        other_size=other_size,
        paused=bool(paused),
        other_paused=bool(other_paused),
        finished=finished,
        earliest_start=earliest / 1000.0 if earliest else None,
        now=now_ms / 1000.0,
    )


class QueueOps(StoreBase):
    """Queue order and completion rates; queue pauses and node drain requests."""

    @redis_boundary
    def queued_ids(self, queue: str, limit: int = 1000) -> list[str]:
        """The first `limit` jobs queued in `queue`, in queue order."""
        _check_queue(queue)
        ids: list[str] = self.redis.zrange(self.keys.queue_index(queue), 0, limit - 1)
        return ids

    @redis_boundary
    def server_run_id(self) -> str:
        """The running Redis server's run_id (a new one on each start)."""
        return str(self.redis.info("server")["run_id"])

    @redis_boundary
    def server_changed(self, queue: str, run_id: str) -> bool:
        """Whether Redis (now `run_id`) restarted since a consumer of `queue` last asked.

        True once per restart. A message a consumer was taking from Redis as it went down is
        gone (kombu's Redis transport removes it from the queue before recording it as
        unacknowledged), while its job stays `queued`: the caller audits the queue at once.
        """
        _check_queue(queue)
        key = self.keys.queue_server(queue)
        if self.redis.get(key) == run_id:
            return False
        # SET .. GET swaps atomically: of several nodes serving `queue`, one sees the old run_id
        # with GET, SET replies with the old value (the stubs know only its plain bool reply)
        seen: str | None = self.redis.set(key, run_id, get=True)  # type: ignore[assignment]
        return seen is not None and seen != run_id

    @redis_boundary
    def queued_counts(self, queues: Sequence[str]) -> dict[str, int]:
        """How many jobs each queue holds (one pipelined read)."""
        for queue in queues:
            _check_queue(queue)
        pipe = self.redis.pipeline(transaction=False)
        for queue in queues:
            pipe.zcard(self.keys.queue_index(queue))
        return {queue: int(n) for queue, n in zip(queues, pipe.execute(), strict=True)}

    @redis_boundary
    def queue_snapshot(
        self, job_id: str, queue: str, other: str | None, rate_queues: Sequence[str]
    ) -> QueueSnapshot:
        """The job's rank in `queue`, the size of `other`, pauses, `rate_queues`' completions."""
        for name in (queue, other or "", *rate_queues):
            if name:
                _check_queue(name)
        self._require_id(job_id)
        keys, args = snapshot_call(self.keys, job_id, queue, other, rate_queues)
        return snapshot_from(self._run("queue_snapshot", keys, args))

    # --- pauses ----------------------------------------------------------------------------------
    @redis_boundary
    def pause_queue(self, queue: str, by: str = "") -> bool:
        """Pause `queue` for every node; True if it was not paused before."""
        _check_queue(queue)
        record = dumps({"paused_at": self.redis_now(), "by": by})
        return bool(self.redis.hsetnx(self.keys.paused_queues, queue, record))

    @redis_boundary
    def resume_queue(self, queue: str) -> bool:
        """Resume `queue`; True if it was paused."""
        _check_queue(queue)
        return bool(self.redis.hdel(self.keys.paused_queues, queue))

    @redis_boundary
    def paused_queues(self) -> dict[str, dict[str, Any]]:
        """Every paused queue with when (`paused_at`, s) and by whom (`by`) it was paused."""
        return {q: json.loads(v) for q, v in self.redis.hgetall(self.keys.paused_queues).items()}

    # --- drain requests --------------------------------------------------------------------------
    @redis_boundary
    def request_drain(self, node_id: str, exit: bool, by: str = "") -> DrainRequest:
        """Ask `node_id` to drain (it applies it at its next poll); replaces an earlier request."""
        if not node_id or len(node_id) > MAX_NODE_ID:
            raise ValueError(f"invalid node id {node_id!r}")
        request = DrainRequest(node_id, exit, self.redis_now(), by)
        payload = {"exit": request.exit, "requested_at": request.requested_at, "by": by}
        self.redis.hset(self.keys.drain_requests, node_id, dumps(payload))
        return request

    @redis_boundary
    def withdraw_drain(self, node_id: str) -> bool:
        """Withdraw the drain request of `node_id`; True if there was one."""
        return bool(self.redis.hdel(self.keys.drain_requests, node_id))

    @redis_boundary
    def drain_requests(self) -> dict[str, DrainRequest]:
        """Every pending drain request, by node id."""
        raw = self.redis.hgetall(self.keys.drain_requests)
        return {node: _drain(node, value) for node, value in raw.items()}

    @redis_boundary
    def node_controls(self, node_id: str) -> tuple[set[str], DrainRequest | None]:
        """What a node polls: the paused queues and its own drain request (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hkeys(self.keys.paused_queues)
        pipe.hget(self.keys.drain_requests, node_id)
        paused, drain = pipe.execute()
        return set(paused), _drain(node_id, drain) if drain else None


def _drain(node_id: str, value: str) -> DrainRequest:
    data = json.loads(value)
    return DrainRequest(
        node_id=node_id,
        exit=bool(data.get("exit")),
        requested_at=float(data.get("requested_at", 0.0)),
        by=str(data.get("by", "")),
    )
