"""Scale to zero and back: a harness plays the autoscaler against real `kiln worker` processes.

It reads `kiln_pipeline_desired_nodes` from a real API's `/metrics` (uvicorn), starts workers of
the sleeping test pipeline while fewer are up than desired, and lets surplus nodes leave by
themselves (`KILN_SURPLUS_EXIT`: an idle node drains and exits 0); one that has not left a while
after it became surplus is SIGTERMed, an idle one first, as a Deployment's scale-down would. A
burst takes the pipeline from 0 to 3 nodes and back to 0; every job runs exactly once (the
pipeline's completions file); the cold start, job submitted -> its first denoising step, is
measured and printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.tasks.api.app import create_app
from kiln.tasks.client.client import KilnClient
from tests.e2e.cluster import SLEEPY, Cluster, WorkerProcess
from tests.tasks.helpers import ThreadServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_NODES = 3
BURST = 36  # 9 batches of 4 at 2 s each: ~18 s of one node's time
STEPS = 20
AUTOSCALE_ENV = {
    "KILN_TEST_STEP_SECONDS": "0.1",
    "KILN_SURPLUS_EXIT": "true",
    "KILN_SURPLUS_GRACE_S": "2",
    "KILN_DESIRED_NODES_MAX": str(MAX_NODES),
    "KILN_TARGET_START_S_INTERACTIVE": "2",
}
JOB = {"pipeline": "sleepy", "width": 64, "height": 64, "steps": STEPS}
TICK_S = 0.5
# a node surplus this long without having left by itself is SIGTERMed (surplus grace 2 s, one
# heartbeat interval to look, Celery's warm shutdown: a few seconds on 2 shared cores)
SIGTERM_AFTER_S = 30.0


def desired_nodes(api_url: str, pipeline: str) -> int:
    """`kiln_pipeline_desired_nodes{pipeline=...}` as the API's /metrics exports it now."""
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kiln_pipeline_desired_nodes" and sample.labels == {
                "pipeline": pipeline
            }:
                return int(sample.value)
    raise AssertionError(f"no kiln_pipeline_desired_nodes for {pipeline!r} in:\n{text}")


@dataclass
class Autoscaler:
    """Starts workers up to the desired count; SIGTERMs surplus ones that linger."""

    cluster: Cluster
    api_url: str
    pipeline: str = "sleepy"
    started: list[WorkerProcess] = field(default_factory=list)
    most_running: int = 0
    sigtermed: int = 0
    surplus_since: float | None = None
    desired_seen: list[int] = field(default_factory=list)

    def running(self) -> list[WorkerProcess]:
        return [w for w in self.started if w.process.poll() is None]

    def tick(self) -> int:
        """One poll of the metric and one scaling step; the desired count read."""
        desired = desired_nodes(self.api_url, self.pipeline)
        self.desired_seen.append(desired)
        running = self.running()
        for _ in range(desired - len(running)):
            extra = {"KILN_TEST_STEP_SECONDS": AUTOSCALE_ENV["KILN_TEST_STEP_SECONDS"]}
            self.started.append(
                self.cluster.start_worker(f"{self.pipeline}={SLEEPY}", extra_env=extra, wait=False)
            )
        self.most_running = max(self.most_running, len(self.running()))
        if desired >= len(running):
            self.surplus_since = None
        elif self.surplus_since is None:
            self.surplus_since = time.monotonic()
        elif time.monotonic() - self.surplus_since > SIGTERM_AFTER_S:
            self.sigterm_one(running)
            self.surplus_since = None
        return desired

    def sigterm_one(self, running: list[WorkerProcess]) -> None:
        """SIGTERM an idle node if there is one, else any (a Deployment's choice)."""

        def busy(worker: WorkerProcess) -> bool:
            beat = worker.heartbeat()
            return bool(beat and beat.get("jobs_running"))

        chosen = sorted(running, key=busy)[0]
        chosen.process.send_signal(15)
        self.sigtermed += 1


def first_step_at(cluster: Cluster, job_id: str) -> float:
    """When the job reported its first denoising step (the Redis clock)."""
    for event in cluster.store.events(job_id, count=1000):
        if event.type == "progress" and event.payload.get("stage") == "denoising":
            return event.time
    raise AssertionError(f"job {job_id} reported no denoising step")


def test_a_burst_scales_the_pipeline_from_zero_to_three_and_back(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory(**AUTOSCALE_ENV)
    settings = cluster.settings.model_copy(update={"auth_enabled": False})
    with (
        ThreadServer(create_app(settings, cluster.storage_settings)) as api,
        KilnClient(api.url) as client,
    ):
        scaler = Autoscaler(cluster, api.url)
        assert scaler.tick() == 0  # nothing queued: no node
        submitted_at = time.monotonic()
        first_job = client.submit({**JOB, "prompt": "burst 0", "seed": 0})
        assert first_job.waiting_for  # no node serves it yet: its view says so
        ids = [first_job.id] + [
            client.submit({**JOB, "prompt": f"burst {i}", "seed": i}).id for i in range(1, BURST)
        ]
        assert desired_nodes(api.url, "sleepy") == MAX_NODES  # at once, before any node is up
        deadline = time.monotonic() + 400
        while True:
            scaler.tick()
            seen = cluster.store.get_many(ids)
            done = all(r is not None and r.finished_at is not None for r in seen)
            if done and not scaler.running() and scaler.desired_seen[-1] == 0:
                break
            assert time.monotonic() < deadline, (
                f"not back to zero: desired {scaler.desired_seen[-5:]}, "
                f"{len(scaler.running())} running\n" + "\n".join(w.log() for w in scaler.started)
            )
            time.sleep(TICK_S)
        back_to_zero_s = time.monotonic() - submitted_at

    records = [r for r in cluster.store.get_many(ids) if r is not None]
    assert [str(r.state) for r in records] == ["succeeded"] * BURST
    assert all(r.attempts == 1 for r in records), [r.attempts for r in records]
    ran = [job for job in cluster.completions.read_text().split() if job in set(ids)]
    assert sorted(ran) == sorted(ids), "a job ran twice or not at all"  # (warm-ups aside)
    codes = [w.process.returncode for w in scaler.started]
    assert codes == [0] * len(codes), codes
    assert scaler.most_running == MAX_NODES
    first = min(records, key=lambda r: r.created_at)
    cold_start_s = first_step_at(cluster, first.id) - first.created_at
    worked = sum(1 for w in scaler.started if "surplus" in w.output())
    print(
        f"\nautoscale: 0 -> {scaler.most_running} -> 0 nodes; {BURST} jobs, each once; "
        f"cold start (first job submitted -> first step) {cold_start_s:.1f} s; "
        f"back to zero {back_to_zero_s:.1f} s after the burst; "
        f"{worked} node(s) left as surplus, {scaler.sigtermed} SIGTERMed"
    )
    assert scaler.sigtermed == 0, "a surplus node did not leave by itself"
