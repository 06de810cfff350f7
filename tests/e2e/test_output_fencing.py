"""A node that resumes after losing its lease cannot touch a committed job's outputs (issue 23).

Two real `kiln worker` nodes of other dtypes (their pixels differ, as on GPUs) serve a pipeline
whose outputs take a while to encode. The node holding the job is frozen (SIGSTOP, its ranks too)
while it encodes and uploads; the other reaps the lease, runs the job again and commits; then the
frozen node resumes and finishes its uploads. The record's outputs must still be the committing
node's bytes, sha256 for sha256, and the late node's outputs must be gone from the store.

`KILN_TEST_RACE_ROUNDS=20` repeats the race 20 times on each store (the issue's count).
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.e2e.cluster import Cluster, WorkerProcess
from tests.e2e.pipelines import noise_frames
from tests.waiting import wait_until

ROUNDS = int(os.environ.get("KILN_TEST_RACE_ROUNDS", "1"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180 + 40 * ROUNDS)]

PIPELINE = "sleepy=python:tests.e2e.pipelines:dtype_noise"
SIZE = 768  # a noise PNG of this size takes ~0.2 s to encode: the node is caught in the act
OUTPUTS = 4
DTYPES = ("float32", "bfloat16")


@contextmanager
def frozen(worker: WorkerProcess) -> Iterator[None]:
    """The node's process and its ranks stopped (SIGSTOP) for the block, then continued."""
    pids = [worker.process.pid, *worker.rank_pids().values()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in reversed(pids):
            os.kill(pid, signal.SIGCONT)


def stage_of(cluster: Cluster, job_id: str) -> str:
    record = cluster.store.get(job_id)
    return str((record.progress or {}).get("stage", "")) if str(record.state) == "running" else ""


def holder_of(cluster: Cluster, job_id: str) -> str:
    return (cluster.store.lease_owner(job_id) or "").split("/")[0]  # owner = node/delivery


def race_once(cluster: Cluster, nodes: dict[str, tuple[WorkerProcess, str]], seed: int) -> None:
    """One round: freeze the holder mid-upload, let the other commit, resume the holder."""
    job_id = cluster.submit(
        pipeline="sleepy",
        prompt="race",
        width=SIZE,
        height=SIZE,
        steps=2,
        num_outputs=OUTPUTS,
        seed=seed,
    )
    # encoding or uploading: past every check for a lost lease before the outputs are written
    wait_until(
        lambda: stage_of(cluster, job_id),
        lambda stage: stage in {"encoding", "uploading"},
        timeout_s=90,
        poll_s=0.01,  # the stage lasts ~0.2 s: look often enough to catch it
    )
    late, late_dtype = nodes[holder_of(cluster, job_id)]
    with frozen(late):
        caught = cluster.store.get(job_id)
        assert str(caught.state) == "running", "the holder finished before it was frozen"
        record = cluster.wait_for(job_id, timeout_s=90)
        resumed_from = len(late.output())
    assert str(record.state) == "succeeded", record.error
    runs = [e for e in cluster.store.events(job_id) if e.type == "running"]
    committer = runs[-1].payload["node_id"]
    assert committer != late.node_id, "the frozen node cannot have committed"
    _, committer_dtype = nodes[committer]
    # the late node resumes, writes its outputs and is refused at its commit
    wait_until(
        lambda: f"job {job_id} ended elsewhere" in late.output()[resumed_from:],
        timeout_s=60,
        what=f"the late attempt's end in {late.node_id}'s log",
    )
    assert len(record.outputs) == OUTPUTS
    for index, output in enumerate(record.outputs):
        data = cluster.objects.get(output["key"])
        assert hashlib.sha256(data).hexdigest() == output["sha256"], output["key"]
        assert len(data) == output["bytes"]
        pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        size = (1, SIZE, SIZE)
        assert np.array_equal(pixels, noise_frames(seed, index, size, dtype(committer_dtype))[0])
        assert not np.array_equal(pixels, noise_frames(seed, index, size, dtype(late_dtype))[0])
    # the late attempt's outputs were deleted: only the committed ones are left
    assert cluster.list_output_keys(job_id) == sorted(o["key"] for o in record.outputs)
    assert cluster.store.get(job_id).outputs == record.outputs


def dtype(name: str) -> torch.dtype:
    result: torch.dtype = getattr(torch, name)
    return result


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_resumed_node_never_overwrites_committed_outputs(
    cluster_factory: Callable[..., Cluster], tmp_path: Path, store: str
) -> None:
    overrides = {"KILN_STORAGE_URL": f"file://{tmp_path}/objects"} if store == "local" else {}
    cluster = cluster_factory(**overrides)
    step_env = {"KILN_TEST_STEP_SECONDS": "0.05"}
    nodes = {}
    for name in DTYPES:
        worker = cluster.start_worker(
            PIPELINE, wait=False, extra_env={**step_env, "KILN_TORCH_DTYPE": name}
        )
        nodes[worker.node_id] = (worker, name)
    for worker, _ in nodes.values():
        worker.wait_ready()
    for round_ in range(ROUNDS):
        race_once(cluster, nodes, seed=1000 + round_)
