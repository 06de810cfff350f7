"""A surplus node leaves by itself (`KILN_SURPLUS_EXIT`; docs/operations.md §16).

Every heartbeat interval an idle node reads its pipelines' desired node counts (tasks/queue/
backlog.py, the number autoscalers read) and live node counts, as one node of the cluster read them
for all within the interval (`SurplusWatch.views`). Once it has been idle while more live nodes than
desired serve each of its pipelines for `KILN_SURPLUS_GRACE_S`, it asks Redis whether it is surplus
(storage/backlog.py `claim_surplus`): one script counts the live nodes that are not draining and, if
there are still too many, writes this node's drain request with `exit`. The operator controls
(tasks/node/controls.py) then drain it and stop it as SIGTERM would: exit 0, no job lost or run
twice (a message fetched meanwhile is published again, a job started meanwhile finishes first). A
node running a job never asks, so scale-down takes idle nodes only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kiln.storage.backlog import VIEW_LIFETIME_INTERVALS
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
        views = self.views()
        if views is None:
            return None
        if all(v["live"] - v["draining"] > v["desired"] for v in views.values()):
            return {pipeline: int(view["desired"]) for pipeline, view in views.items()}
        return None

    def views(self) -> dict[str, dict[str, int]] | None:
        """Per pipeline it serves: desired, live and draining nodes, as the cluster last read them.

        Read once per heartbeat interval by one node for all (storage/backlog.py
        `shared_views`): the backlog read covers every running job and the node count every
        heartbeat, so every idle node reading them each tick would cost the cluster its node
        count squared. None while some pipeline has no view yet.
        """
        store, settings = self.node.store, self.node.settings
        interval_s = settings.heartbeat_interval_s
        names = {pipeline: f"surplus:{pipeline}" for pipeline in self.pipelines}
        found = store.shared_views(list(names.values()))
        views = {pipeline: found[name].value for pipeline, name in names.items()}
        due = [
            pipeline
            for pipeline, name in names.items()
            if found[name].due and store.claim_shared_view(name, self.node.node_id, interval_s)
        ]
        if due:
            live = store.live_nodes()
            for backlog in read_backlogs(store, settings, due):
                counts = node_counts(live, backlog.pipeline)
                view = {
                    "desired": backlog.desired_nodes,
                    "live": counts.live,
                    "draining": counts.draining,
                }
                ttl_s = VIEW_LIFETIME_INTERVALS * interval_s
                store.write_shared_view(names[backlog.pipeline], view, ttl_s)
                views[backlog.pipeline] = view
        if any(view is None for view in views.values()):
            return None
        return {
            pipeline: {k: int(v) for k, v in view.items()}
            for pipeline, view in views.items()
            if view
        }
