"""A node runs its own loops, and the cluster's unless `KILN_NODE_CONTROL_LOOPS=false`."""

from __future__ import annotations

import threading

from kiln.tasks.node.maintenance import Maintenance
from tests.tasks.node.conftest import NodeFactory

NODE_LOOPS = ["heartbeat", "cancels", "held", "owed"]
CLUSTER_LOOPS = [
    "reaper",
    "sweeper",
    "pruner",
    "paused",
    "restarts",
    "audit",
    "batches",
    "preemption",
]


def test_a_node_runs_the_cluster_loops_by_default(make_node: NodeFactory) -> None:
    maintenance = Maintenance(make_node().node)
    assert maintenance.loops.names == NODE_LOOPS + CLUSTER_LOOPS


def test_a_node_without_control_loops_starts_only_its_own(make_node: NodeFactory) -> None:
    harness = make_node(node_control_loops=False)
    maintenance = Maintenance(harness.node)
    assert maintenance.loops.names == NODE_LOOPS
    maintenance.start()
    try:
        running = {t.name for t in threading.enumerate()}
        assert {f"kiln-{name}" for name in NODE_LOOPS} <= running
        assert not {f"kiln-{name}" for name in CLUSTER_LOOPS} & running
        assert harness.store.live_nodes()  # the heartbeat ran at start
    finally:
        maintenance.stop()


def test_a_draining_node_rests_its_batch_feeder(make_node: NodeFactory) -> None:
    node = make_node().node
    (feeder,) = [c for c in Maintenance(node).loops.components if c.name == "batches"]
    assert not feeder.paused()
    node.draining.set()
    assert feeder.paused()
