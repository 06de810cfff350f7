"""A node drained mid-job by SIGTERM or by a spot preemption notice loses at most one step.

Real `kiln worker` nodes serving the tiny video pipeline on CPU. A 40-step job runs on the first
node (checkpoints at the default 30 s cadence: this run takes none on its own); at step 10 the
node gets SIGTERM, or its fake metadata server (a real HTTP server here, AWS's spot
`instance-action` shape, IMDSv2 token and all) starts announcing the machine's reclaim. The node
checkpoints the job's next step, hands it back and exits within a step or two plus a few seconds;
a second node resumes it from that step and the output has the sha256 of the same request run
uninterrupted. The `before` case runs with checkpoints off (`KILN_CHECKPOINT_EVERY_S=0`), as every
job ran before step checkpoints: an 80-step job runs through the drain grace (1 s here, 30 s by
default), is handed back and restarts from step 0.
Marked slow (`make test-slow`). Each case prints its figures (docs/operations.md §4).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

import pytest

from kiln.storage.checkpoints import recorded_checkpoints
from tests.e2e.cluster import Cluster, WorkerProcess
from tests.e2e.test_checkpoint_crash import REQUEST, STEPS, VIDEO
from tests.e2e.test_checkpoint_crash import denoising_steps_reported as denoising_steps
from tests.fake_metadata import AWS_PATH, FakeMetadata

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

DRAIN_AT_STEP = 10


@pytest.fixture
def spot_metadata() -> Iterator[FakeMetadata]:
    fake = FakeMetadata()
    yield fake
    fake.close()


def drain_mid_job(
    cluster: Cluster, first: WorkerProcess, job_id: str, drain: Callable[[], None]
) -> tuple[int, float]:
    """Drain the first node at step DRAIN_AT_STEP; (the step reported then, seconds to exit)."""
    cluster.wait_for_step(job_id, DRAIN_AT_STEP, timeout_s=120)
    at_drain = max(denoising_steps(cluster, job_id))
    started = time.monotonic()
    drain()
    code = first.process.wait(120)
    exit_s = time.monotonic() - started
    assert code == 0, first.log()
    return at_drain, exit_s


def stop_step_logged(worker: WorkerProcess, job_id: str) -> int:
    """The step the node's log says the job's run stops at (its coordinator's stop verdict)."""
    said = re.findall(rf"request {job_id} stops at the end of step (\d+) of", worker.output())
    assert len(said) == 1, worker.log()
    return int(said[0])


@pytest.mark.parametrize("how", ["sigterm", "spot notice", "before: no checkpoints"])
def test_a_drained_node_hands_its_job_back_checkpointed_and_another_resumes_it(
    cluster_factory: Callable[..., Cluster], spot_metadata: FakeMetadata, how: str
) -> None:
    cluster = cluster_factory()
    before = how.startswith("before")
    env = {"KILN_CHECKPOINT_EVERY_S": "0" if before else "30"}
    # before: a job still running at the end of a 1 s grace (80 steps: it outlasts it)
    steps = 80 if before else STEPS
    request = REQUEST | {"steps": steps}
    if before:
        env["KILN_DRAIN_GRACE_S"] = "1"
    if how == "spot notice":
        url = spot_metadata.base + AWS_PATH
        env |= {"KILN_PREEMPTION_NOTICE_URL": url, "KILN_PREEMPTION_POLL_S": "0.2"}
    first = cluster.start_worker(VIDEO, extra_env=env)
    reference = cluster.wait_for(cluster.submit(**request), timeout_s=180)
    assert str(reference.state) == "succeeded", reference.error
    step_s = float(reference.metrics["run_s"]) / steps

    job_id = cluster.submit(**request)

    def drain() -> None:
        if how == "spot notice":
            spot_metadata.notice = True  # the node's watcher sees it at its next poll
        else:
            first.process.terminate()  # SIGTERM, as Kubernetes sends it

    at_drain, exit_s = drain_mid_job(cluster, first, job_id, drain)
    handed_back = cluster.store.get(job_id)
    assert str(handed_back.state) == "queued", handed_back.error
    checkpoints = recorded_checkpoints(cluster.store, job_id)
    # every step the first node ran: the last one reported (the progress of the step it stopped
    # at may go unreported as it stops) or the step its drain checkpointed, which it ran
    computed_first = max([*denoising_steps(cluster, job_id), *(c.steps_done for c in checkpoints)])

    spot_metadata.notice = False  # the second node's machine is not the reclaimed one
    cluster.start_worker(VIDEO, extra_env=env)
    record = cluster.wait_for(job_id, timeout_s=180)
    assert str(record.state) == "succeeded", record.error
    assert record.attempts == 2
    assert [o["sha256"] for o in record.outputs] == [o["sha256"] for o in reference.outputs]
    restored = int(record.metrics.get("steps_restored", 0))
    lost = computed_first - restored  # steps the first node ran that the second ran again
    print(
        f"\n{how}: step {step_s:.2f} s; drained at step {at_drain}, first node ran to step "
        f"{computed_first}, exited {exit_s:.1f} s after the drain; resumed at {restored}; "
        f"steps lost {lost}"
    )
    accounting = record.accounting  # the job's own figures (kiln/common/accounting.py)
    if before:
        assert checkpoints == []
        assert restored == 0  # the whole run again
        assert lost == computed_first
        # every step the first node ran, which its own report may know past its last progress
        # event (the progress writer drops what is pending as the attempt ends)
        assert computed_first <= accounting.steps_recomputed <= stop_step_logged(first, job_id)
        assert accounting.steps_computed == accounting.steps_recomputed + steps
        assert (accounting.steps_restored, accounting.seconds_lost > 0) == (0, True)
        return
    assert len(checkpoints) == 1  # the drain's own: the 30 s cadence took none
    assert checkpoints[0].steps_done == computed_first  # the step it stopped at: none lost
    assert computed_first >= at_drain
    # the group stops at the end of the step after the one whose report met the drain: the step
    # the node's log names, and the one its checkpoint holds (how many steps ran between this
    # test's signal and the node's decision depends on the machine's load, not on Kiln)
    assert computed_first == stop_step_logged(first, job_id)
    assert lost == 0
    assert record.metrics["steps_computed"] == STEPS - restored
    assert (accounting.steps_recomputed, accounting.seconds_lost) == (0, 0)
    assert accounting.steps_restored == restored
    assert accounting.steps_computed == computed_first + STEPS - restored
    if how == "spot notice":
        assert spot_metadata.polls >= 1
