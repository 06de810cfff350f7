"""Messages pushed by the creation script (the API's submit path) run on a real node."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.common.request import Lane
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.messages import CeleryMessages
from kiln.tasks.queue.submit import Submitter, celery_publisher
from tests.e2e.cluster import SLEEPY, Cluster

pytestmark = pytest.mark.timeout(300)


def test_jobs_whose_message_went_with_the_record_run_once_in_both_lanes(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster: Cluster = cluster_factory()
    messages = CeleryMessages(cluster.celery)
    submitter = Submitter(
        cluster.store, cluster.settings, celery_publisher(cluster.celery), messages=messages
    )
    job_ids = []
    for i, lane in enumerate([Lane.bulk, Lane.interactive, Lane.bulk, Lane.interactive]):
        request = JobRequest(
            pipeline="sleepy", prompt=f"p{i}", width=64, height=64, steps=1, priority=lane
        )
        record, created = Intake(submitter, None).submit(request)
        assert created
        assert record.published  # written with its message: nothing for the sweeper
        job_ids.append(record.id)
    assert cluster.store.unpublished_jobs(0) == []
    cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    for job_id in job_ids:
        assert str(cluster.wait_for(job_id, timeout_s=60).state) == "succeeded"
        assert cluster.completion_count(job_id) == 1
    messages.close()
