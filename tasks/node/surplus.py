"""A surplus node leaves by itself (`KILN_SURPLUS_EXIT`; docs/operations.md §16).

Every heartbeat interval an idle node reads its pipelines' desired node counts (tasks/queue/
backlog.py, the number autoscalers read). Once it has been idle while more live nodes than
desired serve each of its pipelines for `KILN_SURPLUS_GRACE_S`, it asks Redis whether it is
surplus (storage/backlog.py `claim_surplus`): one script counts the live nodes that are not
draining and, if there are still too many, writes this node's drain request with `exit`. The
operator controls (tasks/node/controls.py) then drain it and stop it as SIGTERM would: exit 0,
no job lost or run twice (a message fetched meanwhile is published again, a job started
meanwhile finishes first). A node running a job never asks, so scale-down takes idle nodes only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kiln.tasks.node.node import Node
from kiln.tasks.queue.backlog import node_counts, read_backlogs

log = logging.getLogger(__name__)

SURPLUS_BY = "autoscale: surplus"  # the drain request's `by`


class SurplusWatch:
    """Drains this node once it has been idle and surplus for the grace period."""

    def __init__(self, node: Node, pipelines: Sequence[str]) -> None:
        self.node = node
        self.pipelines = sorted(pipelines)
        self.surplus_since: float | None = None  # monotonic; None: not (idle and) surplus

    def tick(self) -> bool:
        """One look; True once this node has claimed its drain."""
        node = self.node
        if node.draining.is_set() or node.controls.shutting_down or node.tracked_jobs():
            self.surplus_since = None
            return False
        desired = self.desired()
        if desired is None:
            self.surplus_since = None
            return False
        now = time.monotonic()
        if self.surplus_since is None:
            self.surplus_since = now
        if now - self.surplus_since < node.settings.surplus_grace_s:
            return False
        if not node.store.claim_surplus(node.node_id, desired, SURPLUS_BY):
            self.surplus_since = None  # others drained first: look again from the start
            return False
        log.info(
            "node %s: surplus (desired %s), draining and exiting",
            node.node_id,
            ", ".join(f"{p}={n}" for p, n in desired.items()),
        )
        return True

    def desired(self) -> dict[str, int] | None:
        """Desired nodes per pipeline it serves, if every one has more live nodes; else None."""
        backlogs = read_backlogs(self.node.store, self.node.settings, self.pipelines)
        live = self.node.store.live_nodes()
        desired = {b.pipeline: b.desired_nodes for b in backlogs}
        serving = {p: node_counts(live, p) for p in self.pipelines}
        if all(serving[p].live - serving[p].draining > n for p, n in desired.items()):
            return desired
        return None
