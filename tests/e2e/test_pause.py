"""A running video job paused mid-run holds no GPU, resumes from its checkpoint, same output.

A real `kiln worker` node serves the tiny video pipeline on CPU. An 80-step job is paused with
`kiln pause` at step 10: the node stops it at its next step with a checkpoint of that step and
the job is `paused`, its lease gone; the node then runs another job to its end while the first
stays paused. `kiln resume` queues it again, and the node resumes it from its checkpoint: the
output has the sha256 of the same request run uninterrupted. Marked slow (`make test-slow`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.storage.checkpoints import recorded_checkpoints
from tests.e2e.cluster import Cluster
from tests.e2e.test_checkpoint_crash import REQUEST as CRASH_REQUEST
from tests.e2e.test_checkpoint_crash import VIDEO
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PAUSE_AT_STEP = 10
# 80 steps: the job still runs after the step it is paused at plus a `kiln pause` process start
STEPS = 80
REQUEST = CRASH_REQUEST | {"steps": STEPS}


def test_a_paused_job_frees_its_node_and_resumes_from_its_checkpoint(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    node = cluster.start_worker(VIDEO, extra_env={"KILN_CHECKPOINT_EVERY_S": "30"})
    reference = cluster.wait_for(cluster.submit(**REQUEST), timeout_s=180)
    assert str(reference.state) == "succeeded", reference.error

    job_id = cluster.submit(**REQUEST)
    cluster.wait_for_step(job_id, PAUSE_AT_STEP, timeout_s=120)
    asked = cluster.run_cli("pause", job_id)
    assert asked.returncode == 0, asked.stderr
    assert "pauses at its next step" in asked.stderr
    paused = cluster.wait_for(job_id, timeout_s=60, states=["paused"])
    assert cluster.store.lease_owner(job_id) is None  # no node holds it
    (checkpoint,) = recorded_checkpoints(cluster.store, job_id)  # the pause's own (30 s cadence)
    assert PAUSE_AT_STEP <= checkpoint.steps_done < STEPS
    assert [
        e.payload.get("reason") for e in cluster.store.events(job_id) if e.type == "paused"
    ] == ["pause_requested"]
    wait_until(
        lambda: node.heartbeat() or {},
        lambda beat: beat.get("jobs_running") == 0,
        what="the node running nothing",
    )

    # its GPU is free: the node runs the next job while this one stays paused
    other = cluster.wait_for(cluster.submit(**REQUEST | {"steps": 4}), timeout_s=180)
    assert str(other.state) == "succeeded", other.error
    assert str(cluster.store.get(job_id).state) == "paused"
    assert paused.attempts == 0  # the paused run is not counted

    resumed = cluster.run_cli("resume", job_id)
    assert resumed.returncode == 0, resumed.stderr
    record = cluster.wait_for(job_id, timeout_s=180)
    assert str(record.state) == "succeeded", record.error
    assert record.attempts == 1
    assert [o["sha256"] for o in record.outputs] == [o["sha256"] for o in reference.outputs]
    restored = int(record.metrics.get("steps_restored", 0))
    assert restored == checkpoint.steps_done > 0  # none of the first run's steps ran again
    types = [e.type for e in cluster.store.events(job_id, count=1000)]
    assert types.index("paused") < types.index("resumed") < types.index("succeeded")
    print(f"\npaused at step {checkpoint.steps_done} of {STEPS}; resumed there ({restored})")
