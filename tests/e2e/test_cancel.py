"""Cancel: a queued job never runs; a running one stops within a step, with no outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.e2e.cluster import SLEEPY, Cluster
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)
# Long enough that a starved node (3 test processes on 2 cores) lags its ranks by less than a
# step: at 0.1 s, a node's progress writes were seen 3 steps behind the rank.
STEP_S = "0.4"


@pytest.fixture(scope="module")
def sleepy_cluster(module_cluster_factory: Callable[..., Cluster]) -> Iterator[Cluster]:
    cluster = module_cluster_factory(KILN_PROGRESS_INTERVAL_S="0")
    yield cluster
    cluster.stop_all()


def test_queued_job_canceled_never_runs(sleepy_cluster: Cluster) -> None:
    job_id = sleepy_cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=3)
    result = sleepy_cluster.run_cli("cancel", job_id, "--json")
    assert result.returncode == 0, result.stderr
    assert '"status": "canceled"' in result.stdout
    sleepy_cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": STEP_S})
    canary = sleepy_cluster.submit(pipeline="sleepy", prompt="y", width=64, height=64, steps=2)
    sleepy_cluster.wait_for(canary, timeout_s=60)  # the worker has drained the queue by now
    assert str(sleepy_cluster.store.get(job_id).state) == "canceled"
    assert [e.type for e in sleepy_cluster.store.events(job_id)] == ["queued", "canceled"]
    assert sleepy_cluster.completion_count(job_id) == 0


def test_running_job_canceled_stops_within_a_step(sleepy_cluster: Cluster) -> None:
    if not sleepy_cluster.workers:
        sleepy_cluster.start_worker(
            f"sleepy={SLEEPY}", extra_env={"KILN_TEST_STEP_SECONDS": STEP_S}
        )
    job_id = sleepy_cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=200)
    sleepy_cluster.wait_for_step(job_id, 2)
    sleepy_cluster.store.cancel(job_id)  # what `kiln cancel` and the API call
    step_at_cancel = int((sleepy_cluster.store.get(job_id).progress or {})["step"])
    record = sleepy_cluster.wait_for(job_id, timeout_s=30)
    assert str(record.state) == "canceled"
    assert record.outputs == []
    assert sleepy_cluster.list_output_keys(job_id) == []
    steps = [
        int(e.payload.get("step", 0))
        for e in sleepy_cluster.store.events(job_id)
        if e.type == "progress" and e.payload.get("stage") == "denoising"
    ]
    # Every step writes progress here. The step in flight when the flag landed may finish (+1);
    # its progress write may trail our read by one step (+1); nothing beyond that.
    assert max(steps) <= step_at_cancel + 2, (step_at_cancel, max(steps))
    # a heartbeat written after the node let go of the job: its run is over, stopped or not
    (worker,) = sleepy_cluster.workers
    wait_until(lambda: worker.heartbeats(1)["jobs_running"], lambda running: running == 0)
    assert sleepy_cluster.completion_count(job_id) == 0
