"""A node's registry reads the node at scrape time: the jobs its group started, its pipelines.

The metrics receive what they read (a count, the pipelines, the coordinator), not the node, so
`tasks.node.metrics` never imports `tasks.node.node` (tests/packaging/test_import_graph.py).
"""

from __future__ import annotations

from tests.tasks.node.conftest import NodeHarness


def jobs_running(harness: NodeHarness) -> float | None:
    node = harness.node
    return node.metrics.registry.get_sample_value(
        "kiln_node_jobs_running", {"node_id": node.node_id}
    )


def test_the_running_gauge_counts_the_jobs_the_nodes_group_started(harness: NodeHarness) -> None:
    first, second = harness.submit(), harness.submit()
    assert jobs_running(harness) == 0
    with harness.node.tracking(first, 1) as first_tracked:
        assert jobs_running(harness) == 0  # held: waiting in the node, not running
        first_tracked.started = True
        assert jobs_running(harness) == 1
        with harness.node.tracking(second, 1) as second_tracked:
            second_tracked.started = True
            assert jobs_running(harness) == 2
    assert jobs_running(harness) == 0


def test_each_served_pipeline_has_an_oom_series_from_the_first_scrape(
    harness: NodeHarness,
) -> None:
    node = harness.node
    for pipeline in node.group_config.pipelines:
        sample = node.metrics.registry.get_sample_value(
            "kiln_node_ooms_total", {"node_id": node.node_id, "pipeline": pipeline}
        )
        assert sample == 0
