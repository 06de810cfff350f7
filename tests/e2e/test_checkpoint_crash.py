"""A node SIGKILLed mid-job: the job resumes on the other node from its last step checkpoint.

Two real `kiln worker` nodes on CPU, one case per scheduler family the tiny pipelines use: the
tiny video pipeline (flow-matching Euler) with the node's cadence (a checkpoint every 0.2 s), and
the tiny image pipeline with Euler (its default), DPM-Solver multistep and DDIM, each image job
asking for its own cadence (`checkpoint: {"every_steps": 2}`: an image takes none by default). A
40-step job's node is killed once a checkpoint past 60 % is recorded; the survivor takes the job
when its lease lapses, resumes from that checkpoint, and the job's output has the sha256 of the
same request run uninterrupted. Marked slow (`make test-slow`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kiln.storage.checkpoints import recorded_checkpoints
from tests.e2e.cluster import Cluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VIDEO = "video=tiny-video"
STEPS = 40
EVERY_S = 0.2
# 176x176x49: about 0.11 s a step on one 2-core node alone (128x128 takes 0.03 s), so the kill,
# pause or drain these tests send at a step lands while the job still runs, and a 0.2 s cadence
# checkpoints every two steps or so
REQUEST = {
    "pipeline": "video",
    "prompt": "a kiln at night",
    "width": 176,
    "height": 176,
    "num_frames": 49,
    "steps": STEPS,
    "seed": 3,
}
IMAGE = "image=tiny"
EVERY_STEPS = 2
# an image of 256x256 takes long enough a step that the kill lands before the job's end
IMAGE_REQUEST = {
    "pipeline": "image",
    "prompt": "a kiln at dusk",
    "width": 256,
    "height": 256,
    "steps": STEPS,
    "seed": 5,
    "checkpoint": {"every_steps": EVERY_STEPS},
}
# (the node's pipeline, its environment, the request, at most the steps a kill may recompute)
CASES: dict[str, tuple[str, dict[str, str], dict[str, Any], int]] = {
    "video, flow-matching Euler": (VIDEO, {"KILN_CHECKPOINT_EVERY_S": str(EVERY_S)}, REQUEST, 5),
    "image, Euler": (IMAGE, {}, IMAGE_REQUEST, EVERY_STEPS + 1),
    "image, DPM-Solver": (
        IMAGE,
        {},
        IMAGE_REQUEST | {"inputs": {"scheduler": "DPMSolverMultistepScheduler"}},
        EVERY_STEPS + 1,
    ),
    "image, DDIM": (
        IMAGE,
        {},
        IMAGE_REQUEST | {"inputs": {"scheduler": "DDIMScheduler"}},
        EVERY_STEPS + 1,
    ),
}


def denoising_steps_reported(cluster: Cluster, job_id: str) -> list[int]:
    """The steps the job's `progress` events reported while denoising, in order."""
    return [
        int(event.payload.get("step", 0))
        for event in cluster.store.events(job_id)
        if event.type == "progress" and event.payload.get("stage") == "denoising"
    ]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_node_killed_at_60_percent_resumes_on_the_other_node_with_the_same_output(
    cluster_factory: Callable[..., Cluster], case: str
) -> None:
    pipeline, env, request, most_recomputed = CASES[case]
    cluster = cluster_factory()
    first = cluster.start_worker(pipeline, extra_env=env)
    second = cluster.start_worker(pipeline, extra_env=env)
    reference = cluster.wait_for(cluster.submit(**request), timeout_s=120)
    assert str(reference.state) == "succeeded", reference.error

    job_id = cluster.submit(**request)
    wait_until(
        lambda: max((r.steps_done for r in recorded_checkpoints(cluster.store, job_id)), default=0),
        lambda steps: steps >= STEPS * 6 // 10,
        timeout_s=120,
        poll_s=0.01,
        what="a checkpoint past 60 %",
    )
    holder = (cluster.store.lease_owner(job_id) or "").split("/")[0]
    victim = first if holder == first.node_id else second
    assert holder == victim.node_id
    victim.kill9()
    assert str(cluster.store.get(job_id).state) == "running"  # killed mid-job, not after it
    restorable = recorded_checkpoints(cluster.store, job_id)[0].steps_done
    reported_before = max(denoising_steps_reported(cluster, job_id))

    record = cluster.wait_for(job_id, timeout_s=120)
    assert str(record.state) == "succeeded", record.error
    assert record.attempts == 2
    assert [o["sha256"] for o in record.outputs] == [o["sha256"] for o in reference.outputs]
    assert record.metrics["steps_restored"] == restorable, record.metrics.get("checkpoints_refused")
    assert record.metrics["steps_computed"] == STEPS - restorable
    # what the kill cost: the steps the first attempt ran past its last recorded checkpoint.
    # Progress is reported on the writer's own throttled thread, so the newest checkpoint may name
    # a step whose progress event never went out: the first attempt ran at least that far.
    ran_to = max(reported_before, restorable)
    recomputed = ran_to - restorable
    print(
        f"{case}: restored {restorable}, recomputed {recomputed} (reported up to {reported_before})"
    )
    # at most the steps of one cadence (0.2 s of video steps; 2 image steps), plus the kill's lag
    assert recomputed <= most_recomputed
    # the job's own accounting says the same: the dead node's attempt read by the reaper from
    # its progress and its checkpoints, the survivor's from its own report
    assert (record.accounting.steps_restored, record.accounting.steps_recomputed) == (
        restorable,
        recomputed,
    )
    assert record.accounting.steps_computed == ran_to + STEPS - restorable
