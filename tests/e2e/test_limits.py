"""Pipeline limits on a real node.

Announced in its heartbeat, enforced at submit, and enforced again on the node before any rank
runs a job that is over them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest

from kiln.storage.job_store import NewJob
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.refusal import Refused
from tests.e2e.cluster import SLEEPY, Cluster
from tests.e2e.pipelines import MAX_STEPS

pytestmark = pytest.mark.timeout(300)


def test_node_announces_limits_and_fails_a_job_over_them_without_running_it(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster: Cluster = cluster_factory()
    cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    (node,) = cluster.store.live_nodes()
    announced = node["limits"]["sleepy"]  # what the pipeline declared on its rank
    assert (announced["max_steps"], announced["max_width"]) == (MAX_STEPS, 1024)

    with pytest.raises(Refused) as refused:
        cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=MAX_STEPS + 1)
    assert refused.value.refusal.context["limit"] == "max_steps"

    # A job that got past submit (written before the limits were known): the node re-checks.
    over = JobRequest(pipeline="sleepy", prompt="x", width=64, height=64, steps=400, seed=1)
    record, _ = cluster.store.create_job(NewJob(id=uuid.uuid4().hex, request=over.to_record()))
    cluster.submitter.publish(record)
    failed = cluster.wait_for(record.id)
    assert str(failed.state) == "failed"
    assert failed.attempts == 0  # never started
    assert failed.error == {
        "type": "pipeline_limit",
        "message": f"steps: sleepy takes steps ≤ {MAX_STEPS}; got 400",
        "retryable": False,
        "limit": "max_steps",
    }
    assert cluster.completion_count(record.id) == 0

    # The group never saw it: it keeps serving and was never rebuilt.
    fine = cluster.submit(pipeline="sleepy", prompt="y", width=64, height=64, steps=2)
    assert str(cluster.wait_for(fine).state) == "succeeded"
    (node,) = cluster.store.live_nodes()
    assert node["coordinator"]["rebuilds"] == 0
