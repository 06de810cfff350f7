"""Replica groups on a real node: `kiln worker --devices cpu:2 --group-size 1` runs two groups.

Two jobs submitted together go one to each group and run at the same time; identical requests
give identical outputs whichever group ran them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.cluster import Cluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # a worker of two groups: ~20-35 s

JOB = {"pipeline": "tiny", "prompt": "two kilns", "width": 128, "height": 128, "seed": 5}


def denoising_span(cluster: Cluster, job_id: str) -> tuple[float, float]:
    """Times of the job's first and last denoising progress events."""
    times = [
        event.time
        for event in cluster.store.events(job_id)
        if event.type == "progress" and event.payload.get("stage") == "denoising"
    ]
    assert times, f"job {job_id} reported no denoising progress"
    return min(times), max(times)


def batches_per_group(cluster: Cluster, total: int, timeout_s: float = 30.0) -> list[int]:
    """Each group's batches as the heartbeat reports them, once they add up to `total`."""

    def batches() -> list[int]:
        (node,) = cluster.store.live_nodes()
        return [int(group["batches_run"]) for group in node["coordinator"]["groups"]]

    # the heartbeat after the jobs finished may be still to come
    return wait_until(batches, lambda seen: sum(seen) >= total, timeout_s=timeout_s)


def test_two_jobs_submitted_together_run_at_once_on_two_groups(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    worker = cluster.start_worker("tiny", devices="cpu:2", extra_args=["--group-size", "1"])
    (node,) = cluster.store.live_nodes()
    assert (node["group_size"], len(node["coordinator"]["groups"])) == (1, 2)
    assert len(worker.rank_pids()) >= 1  # rank 0 of each group (titles: node.g0, node.g1)
    # Many steps: long enough on a shared machine that overlap is not an accident of timing.
    first = cluster.submit(**JOB, steps=60)
    second = cluster.submit(**JOB, steps=60)
    records = [cluster.wait_for(job_id, timeout_s=180) for job_id in (first, second)]
    for record in records:
        assert str(record.state) == "succeeded", record.error
    a_start, a_end = denoising_span(cluster, first)
    b_start, b_end = denoising_span(cluster, second)
    assert a_start < b_end
    assert b_start < a_end
    # One batch on each group: the node fed the idle group, not the busy one.
    assert batches_per_group(cluster, total=2) == [1, 1]
    # Correct on both: the same request gives the same pixels on either group.
    (out_a,), (out_b,) = (record.outputs for record in records)
    assert out_a["sha256"] == out_b["sha256"]
    assert (out_a["width"], out_a["height"]) == (128, 128)
