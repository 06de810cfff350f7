"""Node heartbeats: what each live node serves, kept alive by its TTL.

Each heartbeat also records the job messages the node holds (received from the broker, not yet
finished: waiting for their countdown, or in the moment before their lease is taken). A node
killed then leaves those messages unacknowledged, and the broker gives them back only after its
visibility timeout (an hour by default). `claim_lapsed_holders` hands them to a live node's
sweeper as soon as the dead node's heartbeat deadline passes, with the window in which it died;
the sweeper publishes the still-queued ones again, and those of the broker's unacknowledged
deliveries from that window that no live node holds (`unacked_deliveries`,
tasks/control/unacked.py).
A duplicate message is harmless: the lease and the state machine run a job once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary


@dataclass(frozen=True)
class LapsedHolder:
    """A node whose heartbeat lapsed, with the jobs whose messages it had listed as held.

    It died between its last write, `written_ms`, and `deadline_ms` (Redis clock, ms), perhaps
    holding a message it never got to list (tasks/control/unacked.py looks for those).
    """

    node_id: str
    written_ms: int
    deadline_ms: int
    job_ids: list[str]


@dataclass(frozen=True)
class LapsedHolds:
    """What one claim hands a sweeper: the lapsed nodes, and the jobs live nodes hold now.

    `live_job_ids` is read only when some node lapsed (else empty): only a lapse needs it.
    """

    holders: list[LapsedHolder]
    live_job_ids: set[str]


class NodeOps(StoreBase):
    """Publish and list node heartbeats."""

    @redis_boundary
    def publish_node(self, node_id: str, info: dict[str, Any], ttl_s: float) -> None:
        """Announce `node_id` with `info` for `ttl_s` seconds (call again before it lapses)."""
        # `heartbeat_at`: when the node wrote it, by its clock (`kiln admin nodes` shows its age)
        payload = dumps({**info, "node_id": node_id, "heartbeat_at": time.time()})
        ttl_ms = max(1, int(ttl_s * 1000))
        self._run(
            "publish_node",
            [self.keys.node(node_id), self.keys.nodes],
            [node_id, payload, ttl_ms],
        )

    @redis_boundary
    def live_nodes(self) -> list[dict[str, Any]]:
        """Info of every node whose heartbeat has not lapsed (each with its `node_id`)."""
        infos: list[str] = self._run("live_nodes", [self.keys.nodes], [self.keys.node_prefix])
        return [json.loads(info) for info in infos]

    def served_pipelines(self) -> set[str]:
        """Names of the pipelines that some live node serves right now (from the heartbeats)."""
        return {str(name) for node in self.live_nodes() for name in node.get("pipelines", [])}

    @redis_boundary
    def record_held(
        self, node_id: str, job_ids: list[str], ttl_s: float, incarnation: str = ""
    ) -> None:
        """Record the job messages `node_id` holds, valid until its heartbeat would lapse.

        `incarnation` is a token of the writing process: an entry another process wrote under
        the same node id (a restart with a fixed --node-id) is kept for a sweeper to claim.
        """
        ttl_ms = max(1, int(ttl_s * 1000))
        args = [node_id, ttl_ms, incarnation, *job_ids]
        self._run("held_record", [self.keys.held_deliveries, self.keys.held_deadlines], args)

    @redis_boundary
    def claim_lapsed_holders(self) -> LapsedHolds:
        """The held lists of nodes whose heartbeat lapsed, each handed out once."""
        live, *lapsed = self._run(
            "held_claim",
            [self.keys.held_deliveries, self.keys.last_lapse, self.keys.held_deadlines],
            [],
        )
        holders = [
            LapsedHolder(str(node_id), int(written_ms), int(deadline_ms), [str(j) for j in jobs])
            for node_id, written_ms, deadline_ms, *jobs in lapsed
        ]
        return LapsedHolds(holders, {str(job_id) for job_id in live})

    @redis_boundary
    def unacked_deliveries(
        self, index_key: str, hash_key: str, since_s: float, until_s: float, limit: int
    ) -> list[str]:
        """The broker's unacknowledged deliveries recorded from `since_s` to `until_s`.

        kombu's Redis transport keeps each delivery in `hash_key` (tag -> message) and indexes it
        by its time (the consumer's clock, in seconds) in the sorted set `index_key`. Reads at
        most `limit` of the oldest in the window; a delivery acknowledged meanwhile is left out.
        """
        tags = self.redis.zrangebyscore(index_key, since_s, until_s, start=0, num=limit)
        if not tags:
            return []
        return [value for value in self.redis.hmget(hash_key, tags) if value is not None]
