"""Priority preemption: a late interactive job suspends the bulk job that holds the only node.

One real `kiln worker` node serving the tiny video pipeline on CPU (its own control loops decide:
tasks/control/preemption.py, ticking every 0.2 s here). A long bulk video job (80 steps of
176x176x49, step checkpoints planned at a 3600 s cadence: the run takes none on its own) holds
the node; a 4-step 64x64x17 interactive video job is submitted at step 3. With
`KILN_PRIORITY_PREEMPTION=false` (before) the interactive job waits for the whole bulk run; with
it on (the default) and the interactive lane's target start at 0.5 s, the bulk job is suspended
at a step boundary once the interactive job is late: checkpointed, queued again at the head of
the bulk lane, its attempt not counted. The interactive job runs, then the bulk job resumes from
the very step it stopped at and ends with the output of the uninterrupted run (the before case's,
same request and seed).

The figures are the ratio that matters: the interactive job's wait before its first step is a
whole bulk run before, and the target start plus a tick of the control loop, a step or two and
the hand-off after. Marked slow (`make test-slow`); prints its figures (docs/operations.md §20).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from kiln.storage.checkpoints import recorded_checkpoints
from kiln.storage.job_store import JobRecord
from tests.e2e.cluster import Cluster
from tests.e2e.test_checkpoint_crash import REQUEST, VIDEO
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SMALL = {"width": 64, "height": 64, "num_frames": 17}
STEPS = 80
# the bulk job at REQUEST's size, whose steps last long enough for the suspension to land mid-run
BULK = REQUEST | {"priority": "bulk", "steps": STEPS}
INTERACTIVE = REQUEST | SMALL | {"steps": 4, "seed": 5}
SUBMIT_AT_STEP = 3
TARGET_START_S = 0.5
ENV = {
    "KILN_TARGET_START_S_INTERACTIVE": str(TARGET_START_S),
    "KILN_REAPER_INTERVAL_S": "0.2",  # the control loops' tick, preemption's included
    "KILN_PRIORITY_PREEMPTION_MIN_RUN_S": "0",  # this bulk run lasts seconds, not minutes
    # a plan, so a stop checkpoints its step, but no checkpoint of the cadence's in this run
    "KILN_CHECKPOINT_EVERY_S": "3600",
}


def denoising_at(cluster: Cluster, job_id: str) -> list[float]:
    """When the job's denoising steps were reported (the Redis clock), in order.

    Its last step is written at once (progress writes are throttled, a run's last step is not).
    """
    return [
        event.time
        for event in cluster.store.events(job_id)
        if event.type == "progress" and event.payload.get("stage") == "denoising"
    ]


def first_step_at(cluster: Cluster, job_id: str) -> float:
    """When the job's first denoising step was reported."""
    return denoising_at(cluster, job_id)[0]


def run_pair(cluster: Cluster) -> tuple[JobRecord, JobRecord, float]:
    """A bulk job holding the node, an interactive one submitted at its step 3; both ended.

    Returns (bulk record, interactive record, the interactive job's wait before its first step).
    """
    bulk = cluster.submit(**BULK)
    cluster.wait_for_step(bulk, SUBMIT_AT_STEP, timeout_s=120)
    interactive = cluster.submit(**INTERACTIVE)
    done_interactive = cluster.wait_for(interactive, timeout_s=180)
    done_bulk = cluster.wait_for(bulk, timeout_s=180)
    assert str(done_interactive.state) == "succeeded", done_interactive.error
    assert str(done_bulk.state) == "succeeded", done_bulk.error
    wait_s = first_step_at(cluster, interactive) - done_interactive.created_at
    return done_bulk, done_interactive, wait_s


def test_a_late_interactive_job_suspends_a_bulk_job_which_resumes_with_nothing_recomputed(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()

    # before: preemption off; the interactive job waits for the whole bulk run
    node = cluster.start_worker(VIDEO, extra_env=ENV | {"KILN_PRIORITY_PREEMPTION": "false"})
    reference, waited, waited_s = run_pair(cluster)
    assert reference.finished_at is not None
    assert reference.started_at is not None
    # after the bulk job's last step (the node starts it while the bulk job's output is encoded)
    assert first_step_at(cluster, waited.id) > denoising_at(cluster, reference.id)[-1]
    assert not any(event.type == "preempted" for event in cluster.store.events(reference.id))
    bulk_run_s = reference.finished_at - reference.started_at
    step_s = float(reference.metrics["run_s"]) / STEPS
    assert node.terminate() == 0
    # its heartbeat gone: a node idle in the records would hold every preemption off
    wait_until(lambda: node.node_id not in {n["node_id"] for n in cluster.store.live_nodes()})

    # after: preemption on (the default)
    node = cluster.start_worker(VIDEO, extra_env=ENV)
    bulk, interactive, wait_s = run_pair(cluster)
    # its message went back at the head of the bulk queue with its requeue (not published after)
    assert "its message was not built" not in node.output()

    events = cluster.store.events(bulk.id)
    (preempted,) = [e for e in events if e.type == "preempted"]
    assert preempted.payload == {"for_job": interactive.id, "preemptions": 1}
    queued = next(e for e in events if e.seq == preempted.seq - 1)
    assert queued.type == "queued"
    assert queued.payload["reason"] == "preempted"
    # the interactive job's first step came before the bulk job's end: before its resumed run
    assert first_step_at(cluster, interactive.id) < denoising_at(cluster, bulk.id)[-1]
    resumed = next(e for e in events if e.type == "running" and e.seq > preempted.seq)
    assert first_step_at(cluster, interactive.id) < resumed.time
    # the bulk job resumed from the step its suspension checkpointed: nothing recomputed
    (checkpoint,) = recorded_checkpoints(cluster.store, bulk.id)  # the cadence took none
    reported_before = [
        int(e.payload["step"])
        for e in events
        if e.seq < preempted.seq and e.type == "progress" and e.payload.get("stage") == "denoising"
    ]
    ran_to = max([*reported_before, checkpoint.steps_done])
    restored = int(bulk.metrics["steps_restored"])
    assert restored == checkpoint.steps_done
    recomputed = ran_to - restored
    assert recomputed == 0
    assert bulk.metrics["steps_computed"] == STEPS - restored
    assert [o["sha256"] for o in bulk.outputs] == [o["sha256"] for o in reference.outputs]
    # its suspension counted no attempt: two runs, one attempt; each job succeeded once
    assert bulk.attempts == 1
    assert bulk.accounting.steps_recomputed == 0
    attempt_log = json.loads(
        cluster.store.redis.hget(cluster.store.keys.job(bulk.id), "attempt_log") or "[]"
    )
    assert [entry["attempt"] for entry in attempt_log] == [1, 1]
    assert [entry["outcome"] for entry in attempt_log] == ["queued", "succeeded"]
    assert interactive.attempts == 1
    for job_id in (bulk.id, interactive.id):
        states = [e.type for e in cluster.store.events(job_id)]
        assert states.count("succeeded") == 1

    # where the wait goes, from the interactive job's submission: its start, the bulk job's
    # requeue (after the checkpoint of its last step is written), its first step
    started = next(e for e in cluster.store.events(interactive.id) if e.type == "running")
    since = interactive.created_at
    print(
        f"\nafter: interactive job started +{started.time - since:.2f} s, bulk job requeued "
        f"+{preempted.time - since:.2f} s, interactive first step +{wait_s:.2f} s"
    )
    print(
        f"bulk run {bulk_run_s:.1f} s ({STEPS} steps of {step_s:.2f} s); interactive job's "
        f"wait before its first step: before {waited_s:.1f} s, after {wait_s:.1f} s (target "
        f"start {TARGET_START_S} s); bulk suspended at step {checkpoint.steps_done}, resumed "
        f"at {restored}, steps recomputed {recomputed}; attempts {bulk.attempts}"
    )
