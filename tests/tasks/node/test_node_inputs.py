"""The node checks a job's inputs against its own pipeline's schema before the group runs it."""

from __future__ import annotations

from tests.tasks.node.conftest import NodeHarness
from tests.tasks.test_inputs import TINY_SCHEMA


def test_the_node_runs_inputs_its_schema_takes_and_fails_others_unrun(harness: NodeHarness) -> None:
    harness.coordinator.inputs = {"tiny": TINY_SCHEMA}
    good = harness.submit(inputs={"scheduler": "DDIMScheduler", "eta": 0.5})
    harness.deliver(good)
    assert str(harness.store.get(good).state) == "succeeded"
    (ran,) = harness.coordinator.requests
    assert ran.extra_inputs == {"scheduler": "DDIMScheduler", "eta": 0.5}
    bad = harness.submit(inputs={"eta": 5})
    harness.deliver(bad)
    record = harness.store.get(bad)
    assert str(record.state) == "failed"
    assert record.error is not None
    assert (record.error["type"], record.error["retryable"]) == ("pipeline_input", False)
    assert record.error["message"] == "inputs.eta: tiny takes eta ≤ 1; got 5"
    assert len(harness.coordinator.requests) == 1  # never reached the group
    assert harness.node.health()["inputs"] == {"tiny": TINY_SCHEMA}
