"""A user's own pipeline, from docs/pipelines.md, served from its own folder; a job through it.

As a user does it: the example saved as `solidcolor.py` in a project folder that also holds its
own `tasks.py` (which must never be imported by Kiln) and a client script; `kiln worker` and
`kiln api` started from that folder with the console script and no PYTHONPATH; the client script
imports `from kiln import KilnClient, JobRequest` as the README shows.

Real worker subprocess (one CPU rank), real Redis, moto S3, a real `kiln api` (uvicorn).
"""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kiln.tasks.cli.embedded import free_port, wait_for_port
from tests.docs.pipeline_example import write_example
from tests.e2e.cluster import Cluster, WorkerProcess

pytestmark = pytest.mark.timeout(300)

KILN = str(Path(sys.executable).parent / "kiln")
USERS_TASKS = "raise RuntimeError('Kiln imported the project's own tasks.py')\n"
CLIENT = """
import json, sys
from kiln import KilnClient, JobRequest

with KilnClient(sys.argv[1]) as client:
    job = client.submit(JobRequest(pipeline="solid", prompt="a kiln", width=64, height=64,
                                   steps=3, seed=5, inputs={"brightness": 0.5}))
    done = client.wait(job.id, timeout=120, poll_s=0.2)
    print(json.dumps({"id": done.id, "status": done.status,
                      "keys": [output.key for output in done.outputs]}))
"""


def test_the_docs_pipeline_serves_a_job_from_its_own_folder(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(KILN_AUTH_ENABLED="false")
    project = tmp_path / "project"
    project.mkdir()
    write_example(project)
    (project / "tasks.py").write_text(USERS_TASKS)
    (project / "client.py").write_text(CLIENT)
    env = {k: v for k, v in cluster.env.items() if k != "PYTHONPATH"}

    node_id = f"node-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [KILN, "worker", "--pipeline", "solid=python:solidcolor:make", "--node-id", node_id],
            cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    worker = WorkerProcess(process, node_id, log_path, cluster.store)
    cluster.workers.append(worker)
    worker.wait_ready()

    port = free_port()
    with (tmp_path / "api.log").open("wb") as log:
        api = subprocess.Popen(
            [KILN, "api", "--port", str(port)], cwd=project, env=env, stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for_port(port, 60)
        result = subprocess.run(
            [sys.executable, "client.py", f"http://127.0.0.1:{port}"],
            cwd=project, env=env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        api.send_signal(signal.SIGTERM)
        api.wait(30)
    assert result.returncode == 0, result.stderr + worker.log()
    job = json.loads(result.stdout)
    assert job["status"] == "succeeded", worker.log()
    (key,) = job["keys"]
    pixels = np.asarray(Image.open(io.BytesIO(cluster.objects.get(key))).convert("RGB"))
    colour = (np.random.default_rng(5).integers(0, 256, (1, 3))[0] * 0.5).astype(np.uint8)
    assert pixels.shape == (64, 64, 3)
    assert (pixels == colour).all()
    assert "Traceback" not in worker.output()
