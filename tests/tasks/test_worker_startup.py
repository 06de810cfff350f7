"""`kiln worker` start-up through the real console script.

Refusals are one line, and a worker without a pipeline says that it only delivers webhooks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from kiln.storage.settings import StorageSettings
from tests.waiting import wait_for_line

KILN = Path(sys.executable).with_name("kiln")  # the console script installed next to python
REFUSAL_TIMEOUT_S = 120.0  # generous: the CLI imports torch before it refuses
START_TIMEOUT_S = 120.0
# Nothing listens on port 1: should a refused worker get as far as Celery, it reaches no Redis.
NO_REDIS = "redis://127.0.0.1:1/0"


def run_kiln(*args: str) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS...` to completion, with output captured and no reachable Redis."""
    env = {**os.environ, "KILN_REDIS_URL": NO_REDIS}
    return subprocess.run(
        [str(KILN), *args], env=env, capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S
    )


def test_a_cuda_device_the_machine_lacks_is_one_line_naming_the_flag() -> None:
    absent = f"cuda:{torch.cuda.device_count()}"  # cuda:0 on a CPU build of torch
    done = run_kiln("worker", "--pipeline", "tiny", "--devices", absent)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr  # one line, no trace
    assert done.stderr.startswith(f"kiln: --devices {absent}: {absent} asked for")


def test_parallel_none_on_several_devices_is_one_line_saying_what_to_use() -> None:
    done = run_kiln("worker", "--pipeline", "tiny", "--devices", "cpu:2", "--parallel", "none")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith("kiln: --parallel none: parallel mode 'none' on 2 ranks")
    assert "use 'auto' (the default)" in done.stderr


def test_a_worker_without_a_pipeline_says_it_only_delivers_webhooks(
    storage_settings: StorageSettings, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "KILN_REDIS_URL": storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": storage_settings.storage_url,
    }
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "w") as stderr:
        worker = subprocess.Popen(
            [str(KILN), "worker", "--concurrency", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        notice = wait_for_line(stderr_path, "only delivers webhooks", worker)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(START_TIMEOUT_S)
    assert notice == (
        "kiln worker: no --pipeline given, so this worker serves no pipeline and only delivers "
        "webhooks (queue 'webhooks')"
    )
    lines = stderr_path.read_text().splitlines()
    assert sum("only delivers webhooks" in line for line in lines) == 1
