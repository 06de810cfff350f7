"""A frozen node whose job moved on can change neither the later checkpoints nor the outputs.

Two real `kiln worker` nodes serving the tiny video pipeline on CPU, checkpoints every 0.2 s. The
node running a 40-step job is frozen (SIGSTOP, its ranks too) once a checkpoint past 40 % is
recorded; its lease lapses, the other node resumes the job from that checkpoint, takes its own
checkpoints and commits. Then the frozen node is continued: it goes on computing where it was
stopped, and its next checkpoint write and its end meet a lease token that lost. The job's record
(its outputs, its recorded checkpoints, its attempts) must be what it was at the commit, the
output must have the uninterrupted run's sha256, and the late node must leave no object behind.
Marked slow (`make test-slow`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kiln.storage.checkpoints import recorded_checkpoints
from tests.e2e.cluster import Cluster
from tests.e2e.test_checkpoint_crash import EVERY_S, REQUEST, STEPS, VIDEO
from tests.e2e.test_output_fencing import frozen, holder_of
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_frozen_node_continued_after_its_job_moved_on_changes_nothing(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    env = {"KILN_CHECKPOINT_EVERY_S": str(EVERY_S)}
    nodes = [cluster.start_worker(VIDEO, extra_env=env) for _ in range(2)]
    reference = cluster.wait_for(cluster.submit(**REQUEST), timeout_s=120)
    assert str(reference.state) == "succeeded", reference.error

    job_id = cluster.submit(**REQUEST)
    wait_until(
        lambda: max((r.steps_done for r in recorded_checkpoints(cluster.store, job_id)), default=0),
        lambda steps: steps >= STEPS * 4 // 10,
        timeout_s=120,
        poll_s=0.01,
        what="a checkpoint past 40 %",
    )
    late = next(node for node in nodes if node.node_id == holder_of(cluster, job_id))
    with frozen(late):
        assert str(cluster.store.get(job_id).state) == "running"  # frozen mid-job
        frozen_at = recorded_checkpoints(cluster.store, job_id)[0]
        record = cluster.wait_for(job_id, timeout_s=120)  # the lease lapses; the other resumes
        continued_from = len(late.output())
    assert str(record.state) == "succeeded", record.error
    assert [o["sha256"] for o in record.outputs] == [o["sha256"] for o in reference.outputs]
    assert record.metrics["steps_restored"] >= frozen_at.steps_done
    # the record keeps the newest few: by now the resuming attempt's own, later ones
    committed = recorded_checkpoints(cluster.store, job_id)
    assert committed, "the resuming node took checkpoints of its own"
    assert all(c.lease_token > frozen_at.lease_token for c in committed), committed
    assert all(c.steps_done > frozen_at.steps_done for c in committed), committed

    # the frozen node goes on where it was: its lease is gone, so it stops and records nothing
    wait_until(
        lambda: late.output()[continued_from:],
        lambda text: (
            f"job {job_id} stopped after its lease was lost" in text
            or f"job {job_id} ended elsewhere" in text
            or f"job {job_id}: lease lost" in text
        ),
        timeout_s=60,
        what=f"the late attempt's end in {late.node_id}'s log",
    )
    wait_until(  # and whatever it wrote is cleaned up by its own refused writes
        lambda: cluster.list_output_keys(job_id),
        lambda keys: keys == sorted(o["key"] for o in record.outputs),
        timeout_s=30,
        what="only the committed outputs under the job's folder",
    )
    after = cluster.store.get(job_id)
    assert (str(after.state), after.outputs, after.attempts) == (
        "succeeded",
        record.outputs,
        record.attempts,
    )
    assert recorded_checkpoints(cluster.store, job_id) == committed
