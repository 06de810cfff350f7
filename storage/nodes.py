"""Node heartbeats: what each live node serves, kept alive by its TTL.

Each heartbeat also records the job messages the node holds (received from the broker, not yet
finished: waiting for their countdown, or in the moment before their lease is taken). A node
killed then leaves those messages unacknowledged, and the broker gives them back only after its
visibility timeout (an hour by default). `claim_lapsed_held` hands them to a live node's sweeper
as soon as the dead node's heartbeat deadline passes; the sweeper publishes the still-queued ones
again. A duplicate message is harmless: the lease and the state machine run a job once.
"""

from __future__ import annotations

import json
from typing import Any

from kiln.storage.base import StoreBase, dumps
from kiln.storage.boundary import redis_boundary


class NodeOps(StoreBase):
    """Publish and list node heartbeats."""

    @redis_boundary
    def publish_node(self, node_id: str, info: dict[str, Any], ttl_s: float) -> None:
        """Announce `node_id` with `info` for `ttl_s` seconds (call again before it lapses)."""
        payload = dumps({**info, "node_id": node_id})
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
    def record_held(self, node_id: str, job_ids: list[str], ttl_s: float) -> None:
        """Record the job messages `node_id` holds, valid until its heartbeat would lapse."""
        ttl_ms = max(1, int(ttl_s * 1000))
        self._run("held_record", [self.keys.held_deliveries], [node_id, ttl_ms, *job_ids])

    @redis_boundary
    def claim_lapsed_held(self) -> list[str]:
        """Job ids held by nodes whose heartbeat lapsed; each list is handed out once."""
        job_ids: list[str] = self._run("held_claim", [self.keys.held_deliveries], [])
        return sorted(set(job_ids))
