"""A worker's start and stop print no warning: a real `kiln worker`, stopped as a supervisor does.

The worker serves the demo's pipelines on two CPU ranks (warm-up runs the context-parallel path
of `tiny-video`) and is stopped by SIGTERM to its whole process group, as `kill -- -PGID`, a
terminal or a supervisor stopping the group do: the ranks get it too, unless they stand apart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from tests.waiting import wait_until

KILN = Path(sys.executable).with_name("kiln")  # the console script installed next to python
START_TIMEOUT_S = 240.0  # generous: two ranks import torch and build the tiny pipelines
STOP_TIMEOUT_S = 120.0
NOISE = (
    "warn",
    "deprecated",
    "expected input tensor",
    "leaked semaphore",
    "requires torchvision",
    "superuser",
    "worker group died",
)


@pytest.mark.slow
def test_a_worker_starts_and_stops_without_a_warning(
    storage_settings: StorageSettings, job_store: JobStore, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "KILN_REDIS_URL": storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": storage_settings.storage_url,
        "KILN_METRICS_PORT": "0",
    }
    node_id = "quiet-node"
    output_path = tmp_path / "worker.log"
    args = [str(KILN), "worker", "--devices", "cpu:2", "--node-id", node_id]
    args += ["--pipeline", "default=tiny", "--pipeline", "tiny-video"]
    with open(output_path, "w") as output:
        worker = subprocess.Popen(
            args, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        # Up: its heartbeat is out (group warm) and Celery consumes (its signal handlers are on).
        def up() -> tuple[bool, bool]:
            assert worker.poll() is None, output_path.read_text()
            text = output_path.read_text()
            beating = any(n.get("node_id") == node_id for n in job_store.live_nodes())
            return beating, f"{node_id}@" in text and " ready." in text

        try:
            wait_until(up, all, timeout_s=START_TIMEOUT_S, poll_s=0.2, what="(heartbeat, ready)")
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{output_path.read_text()}") from None
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(STOP_TIMEOUT_S) == 0, output_path.read_text()
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    text = output_path.read_text()
    noisy = [line for line in text.splitlines() if any(n in line.lower() for n in NOISE)]
    assert noisy == [], text
