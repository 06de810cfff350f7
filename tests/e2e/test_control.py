"""`kiln control` runs the cluster's loops alone, beside nodes started without theirs.

Real processes: one `kiln control`, two `kiln worker` nodes with `KILN_NODE_CONTROL_LOOPS=false`
(each renews its own leases; none reaps, sweeps, audits or feeds). A node killed with SIGKILL
mid-job loses nothing: the control process reaps its job and the other node finishes it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import REPO_ROOT, SLEEPY, Cluster
from tests.e2e.test_recovery import assert_one_output_set
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLEEPY_PIPELINE = f"sleepy={SLEEPY}"
STEP_ENV = {"KILN_TEST_STEP_SECONDS": "0.2"}


class ControlProcess:
    """One `kiln control` subprocess and its log."""

    def __init__(self, cluster: Cluster) -> None:
        self.log_path = cluster.tmp / "control.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kiln.tasks.cli", "control"],
                env=cluster.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
            )

    def output(self) -> str:
        """Everything it logged so far."""
        return Path(self.log_path).read_text(errors="replace")

    def wait_started(self) -> None:
        """Block until it says its loops run."""
        wait_until(
            self.output,
            lambda text: "kiln control control-" in text or self.process.poll() is not None,
            timeout_s=60,
            what="kiln control started",
        )
        assert self.process.poll() is None, self.output()

    def terminate(self) -> int:
        """SIGTERM; its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(30)


@pytest.fixture
def cluster(cluster_factory: Callable[..., Cluster]) -> Cluster:
    """A cluster whose nodes run no cluster loop of their own."""
    return cluster_factory(KILN_NODE_CONTROL_LOOPS="false")


@pytest.fixture
def control(cluster: Cluster) -> Iterator[ControlProcess]:
    """`kiln control` on the cluster, stopped afterwards."""
    process = ControlProcess(cluster)
    yield process
    if process.process.poll() is None:
        process.process.kill()
        process.process.wait(10)


def test_a_node_killed_while_control_holds_the_loops_loses_nothing(
    cluster: Cluster, control: ControlProcess
) -> None:
    control.wait_started()
    first = cluster.start_worker(SLEEPY_PIPELINE, extra_env=STEP_ENV)
    second = cluster.start_worker(SLEEPY_PIPELINE, extra_env=STEP_ENV)
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=20)
    cluster.wait_for_step(job_id, 3)
    holder = (cluster.store.lease_owner(job_id) or "").split("/")[0]  # owner = node/delivery
    victim, survivor = (first, second) if holder == first.node_id else (second, first)
    assert victim.node_id == holder
    victim.kill9()

    record = cluster.wait_for(job_id, timeout_s=90)
    assert record.attempts == 2
    assert_one_output_set(cluster, job_id, num_outputs=1)
    assert any(e.payload.get("node_id") == survivor.node_id for e in cluster.store.events(job_id))
    # the control process reaped it: the nodes run no reaper
    assert f"reaped job {job_id}" in control.output()
    own_loops = "loops: heartbeat, cancels, held, owed, controls (the cluster's: kiln control's)"
    assert own_loops in survivor.output()
    assert "reaped job" not in survivor.output()
    assert control.terminate() == 0
    assert survivor.terminate() == 0
