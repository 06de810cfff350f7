"""A job a node ends before any attempt goes through the node's one sink.

An expiry at delivery or a refusal over limits: the node's listeners (its metrics) and the job's
webhooks hear it as they hear an attempt's end.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kiln.common.states import JobState
from kiln.tasks.webhooks.event_sink import EventNote
from tests.tasks.node.conftest import NodeFactory
from tests.tasks.test_webhooks import RecordingProducer


@pytest.mark.parametrize(
    ("fields", "state"),
    [({"start_by": time.time() - 1}, JobState.EXPIRED), ({"steps": 200}, JobState.FAILED)],
    ids=["expired_at_delivery", "refused_over_limits"],
)
def test_an_end_before_any_attempt_goes_through_the_nodes_sink(
    make_node: NodeFactory, fields: dict[str, Any], state: JobState
) -> None:
    harness = make_node(limits={"tiny": {"max_steps": 100}})
    producer = RecordingProducer()
    harness.node.events.app = producer  # type: ignore[assignment]  # Celery's producer side
    heard: list[EventNote] = []
    harness.node.events.add_listener(heard.append)
    hook = {"url": "https://hooks.example.com/kiln", "events": ["completed", "dead"]}
    job_id = harness.submit(webhook=hook, **fields)

    harness.deliver(job_id)

    assert harness.store.get(job_id).state == state
    assert harness.event_types(job_id) == ["queued", str(state)]
    assert heard == [EventNote(job_id, str(state))]  # the node's listeners, as for any end
    counted = harness.node.metrics.registry.get_sample_value(
        "kiln_node_job_events_total", {"node_id": harness.node.node_id, "type": str(state)}
    )
    assert counted == 1.0
    expected = ["dead", "completed"] if state == JobState.FAILED else ["completed"]
    assert [t.kwargs["event"] for t in producer.sent] == expected  # the job's webhooks
    assert {t.kwargs["job_id"] for t in producer.sent} == {job_id}
