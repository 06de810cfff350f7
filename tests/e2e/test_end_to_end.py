"""End to end with the tiny pipeline: real `celery worker` node, real Redis, moto S3."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.gpu_worker.pipelines.tiny import ensure_tiny
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny_cluster(module_cluster_factory: Callable[..., Cluster]) -> Iterator[Cluster]:
    cluster = module_cluster_factory()
    # Built here, so that the node finds them built as a node does after its first start (the
    # node builds a missing tiny pipeline itself, with torch: make test's model cache starts empty).
    for kind in ("tiny", "tiny-video"):
        ensure_tiny(kind, GpuWorkerSettings().model_cache)
    cluster.start_worker("default=tiny", "tiny-video", devices="cpu:2")
    yield cluster
    cluster.stop_all()


def assert_outputs_in_store(cluster: Cluster, job_id: str, expected: int) -> None:
    record = cluster.store.get(job_id)
    assert str(record.state) == "succeeded", record.error
    assert len(record.outputs) == expected
    for index, output in enumerate(record.outputs):
        # the job's folder, the attempt's own folder in it (lease token and nonce), the index
        shape = rf"(.*/)?{job_id}/[0-9]+-[0-9a-f]{{8}}/{index}\.[a-z0-9]+"
        assert re.fullmatch(shape, output["key"])
        data = cluster.objects.get(output["key"])
        assert len(data) == output["bytes"]
        assert hashlib.sha256(data).hexdigest() == output["sha256"]


def test_submit_through_tasks_submit_succeeds_with_verified_outputs(tiny_cluster: Cluster) -> None:
    job_id = tiny_cluster.submit(
        pipeline="default", prompt="a red fox", width=64, height=64, steps=4, num_outputs=2
    )
    record = tiny_cluster.wait_for(job_id, timeout_s=120)
    assert_outputs_in_store(tiny_cluster, job_id, expected=2)
    assert record.outputs[0]["content_type"] == "image/png"
    assert (record.outputs[0]["width"], record.outputs[0]["height"]) == (64, 64)
    assert record.attempts == 1
    events = tiny_cluster.store.events(job_id)
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1))
    types = [e.type for e in events]
    assert types[0] == "queued"
    assert types[-1] == "succeeded"
    assert "running" in types
    assert "progress" in types
    for metric in ("queue_s", "run_s", "encode_s", "upload_s", "peak_memory_mb"):
        assert metric in record.metrics


def test_video_job_produces_mp4(tiny_cluster: Cluster) -> None:
    job_id = tiny_cluster.submit(
        pipeline="tiny-video",
        prompt="waves",
        width=64,
        height=64,
        num_frames=5,
        steps=2,
        output_format="mp4",
    )
    record = tiny_cluster.wait_for(job_id, timeout_s=120)
    assert_outputs_in_store(tiny_cluster, job_id, expected=1)
    assert record.outputs[0]["content_type"] == "video/mp4"
    assert record.outputs[0]["frames"] == 5


def test_submit_through_cli_waits_and_prints_outputs(tiny_cluster: Cluster) -> None:
    result = tiny_cluster.run_cli(
        "submit",
        "a lighthouse",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "3",
        "--wait",
        "--json",
        "--timeout",
        "120",
    )
    assert result.returncode == 0, result.stderr
    import json

    view = json.loads(result.stdout)
    assert view["status"] == "succeeded"
    assert_outputs_in_store(tiny_cluster, view["id"], expected=1)
    assert view["outputs"][0]["url"].startswith("http")


def test_cli_user_mistake_is_one_line_and_exit_2(tiny_cluster: Cluster) -> None:
    result = tiny_cluster.run_cli("submit", "x", "--width", "65")
    assert result.returncode == 2
    assert "width" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_unknown_job_is_one_line(tiny_cluster: Cluster) -> None:
    result = tiny_cluster.run_cli("status", "nope")
    assert result.returncode != 0
    assert "nope" in result.stderr
    assert "Traceback" not in result.stderr


def test_same_seed_gives_same_bytes(tiny_cluster: Cluster) -> None:
    fields = dict(pipeline="default", prompt="same", width=64, height=64, steps=3, seed=42)
    first, second = tiny_cluster.submit(**fields), tiny_cluster.submit(**fields)
    a, b = tiny_cluster.wait_for(first, 120), tiny_cluster.wait_for(second, 120)
    assert a.outputs[0]["sha256"] == b.outputs[0]["sha256"]


def mapped_torch(pid: int) -> bool:
    """Whether process `pid` has torch's native library mapped: it imported torch."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch_cpu" in maps


def test_the_node_runs_jobs_without_importing_torch(tiny_cluster: Cluster) -> None:
    # The ranks import torch; the node only forwards, encodes and uploads: a node that imported
    # torch paid seconds of CPU at every start for nothing (docs/performance.md).
    job_id = tiny_cluster.submit(pipeline="default", prompt="torch", width=64, height=64, steps=2)
    tiny_cluster.wait_for(job_id, 120)
    (worker,) = tiny_cluster.workers
    ranks = worker.rank_pids()
    assert sorted(ranks) == [0, 1]
    assert all(mapped_torch(pid) for pid in ranks.values())
    assert not mapped_torch(worker.process.pid), "the node imported torch"
