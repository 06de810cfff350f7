"""Submission edge cases against a real node: a lost publish, and lane priority."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.common.request import Lane
from kiln.tasks.cli.main import EXIT_WAIT_TIMEOUT
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.submit import Submitter
from tests.e2e.cluster import SLEEPY, Cluster

pytestmark = pytest.mark.timeout(300)


def failing_publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
    del job_id, queue, countdown  # the Publish signature
    raise ConnectionError("broker unreachable")


def test_job_whose_publish_failed_is_accepted_and_swept_later(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster: Cluster = cluster_factory(KILN_SWEEPER_AGE_S="1")
    broken = Submitter(cluster.store, cluster.settings, failing_publish)
    request = JobRequest(pipeline="sleepy", prompt="x", width=64, height=64, steps=2)
    record, created = Intake(broken, None).submit(request)
    assert created  # accepted; the failure is the sweeper's to fix
    assert not record.published
    assert cluster.store.unpublished_jobs(0) == [record.id]
    cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    done = cluster.wait_for(record.id, timeout_s=60)
    assert str(done.state) == "succeeded"
    assert cluster.completion_count(record.id) == 1


def test_submit_many_writes_in_bulk_and_every_job_runs(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster: Cluster = cluster_factory()
    requests = [
        JobRequest(
            pipeline="sleepy", prompt=f"bulk {i}", width=64, height=64, steps=1, priority=Lane.bulk
        )
        for i in range(6)
    ]
    job_ids = cluster.submit_many(requests)
    records = cluster.store.get_many(job_ids)
    assert all(r is not None and r.published and r.lane == "bulk" for r in records)
    cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": "0.01"})
    for job_id in job_ids:
        assert str(cluster.wait_for(job_id, timeout_s=60).state) == "succeeded"
        assert cluster.completion_count(job_id) == 1


def test_cli_wait_timeout_is_one_line(cluster_factory: Callable[..., Cluster]) -> None:
    cluster: Cluster = cluster_factory()
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=1)
    result = cluster.run_cli("wait", job_id, "--timeout", "0.5", "--wait-for-node")
    assert result.returncode == EXIT_WAIT_TIMEOUT
    assert "not finished" in result.stderr
    assert "Traceback" not in result.stderr


def test_interactive_jobs_start_first_and_bulk_still_gets_its_share(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster: Cluster = cluster_factory(KILN_BULK_SHARE_EVERY="4")
    bulk = [
        cluster.submit(
            pipeline="sleepy", prompt=f"b{i}", width=64, height=64, steps=1, priority=Lane.bulk
        )
        for i in range(4)
    ]
    interactive = [
        cluster.submit(pipeline="sleepy", prompt=f"i{i}", width=64, height=64, steps=1)
        for i in range(8)
    ]
    # One job at a time, so the start order is the consumption order.
    cluster.start_worker(
        f"sleepy={SLEEPY}",
        extra_env={"KILN_TEST_STEP_SECONDS": "0.01"},
        extra_args=["--concurrency", "1", "--max-batch", "1"],
    )
    records = [cluster.wait_for(job_id, timeout_s=120) for job_id in bulk + interactive]
    order = [r.id for r in sorted(records, key=lambda r: r.started_at or 0)]
    lanes = ["bulk" if job_id in bulk else "interactive" for job_id in order]
    assert lanes[:5] == ["interactive"] * 4 + ["bulk"], lanes
    assert lanes[5:10] == ["interactive"] * 4 + ["bulk"], lanes
