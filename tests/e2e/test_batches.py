"""Batches end to end: `kiln batch` against real node workers running the sleepy pipeline.

The feeder runs inside the nodes' maintenance loops; the CLI (no --api) validates the file and
records the batch; the nodes create, run and report its jobs within the window.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchFeeding, BatchStore, FedBatch
from kiln.tasks.batches.intake import batch_job_id
from tests.e2e.cluster import REPO_ROOT, SLEEPY, Cluster
from tests.storage.helpers import feeder_of
from tests.waiting import wait_until

SLEEPY_PIPELINE = f"sleepy={SLEEPY}"
FAST_FEEDING = {
    "KILN_BATCH_FEED_INTERVAL_S": "0.1",
    "KILN_BATCH_RESULTS_FLUSH_S": "0.5",
}


def stuck_lines(cluster: Cluster, batch_id: str, custom_ids: list[str]) -> list[str]:
    """What the store says of each line's job that has not succeeded: to find why it stalled."""
    lines = []
    for custom_id in custom_ids:
        job_id = batch_job_id(batch_id, custom_id)
        (record,) = cluster.store.get_many([job_id])
        if record is None:
            lines.append(f"{custom_id}: no job (not fed yet)")
        elif record.state != JobState.SUCCEEDED:
            events = [e.type for e in cluster.store.events(job_id)]
            lease = cluster.store.lease_owner(job_id)
            lines.append(
                f"{custom_id}: {record.state} attempts={record.attempts} "
                f"published={record.published} lease={lease} events={events}"
            )
    return lines


def write_batch(path: Path, count: int, steps: int = 2) -> list[str]:
    custom_ids = [f"line-{n:05d}" for n in range(count)]
    with path.open("w") as handle:
        for custom_id in custom_ids:
            line = {"custom_id": custom_id, "prompt": "p", "width": 64, "height": 64}
            handle.write(json.dumps({**line, "steps": steps}) + "\n")
    return custom_ids


def start_submit(cluster: Cluster, path: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kiln.tasks.cli", "batch", "submit", str(path), *args],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )


def the_batch(batches: BatchStore, timeout_s: float = 60.0) -> FedBatch:
    page = wait_until(lambda: batches.list_fed()[0], timeout_s=timeout_s, what="a batch recorded")
    return page[0]


def watch(batches: BatchStore, batch_id: str, timeout_s: float) -> tuple[FedBatch, int]:
    """Poll until the batch ends; returns it and the most of its jobs queued or running."""
    most = 0

    def observe() -> FedBatch:
        nonlocal most
        batch = batches.get_fed(batch_id)
        most = max(most, batch.counts[JobState.QUEUED] + batch.counts[JobState.RUNNING])
        return batch

    return wait_until(observe, lambda batch: batch.final, timeout_s=timeout_s), most


def read_results(cluster: Cluster, batch_id: str, out: Path) -> list[dict[str, Any]]:
    answer = cluster.run_cli("batch", "results", batch_id, "-o", str(out))
    assert answer.returncode == 0, answer.stderr
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def check_results(cluster: Cluster, batch_id: str, custom_ids: list[str], out: Path) -> None:
    lines = read_results(cluster, batch_id, out)
    results, summary = lines[:-1], lines[-1]
    assert summary["type"] == "summary"
    assert summary["batch"]["status"] == "completed"
    assert len(results) == len(custom_ids)
    assert sorted(r["custom_id"] for r in results) == custom_ids  # unique, none missing
    assert {r["status"] for r in results} == {"succeeded"}
    for result in results:
        (output,) = result["outputs"]
        job_folder = output["key"].split("/")[-3]  # <job>/<attempt>/<n>.<ext>
        assert job_folder == batch_job_id(batch_id, result["custom_id"])
        head = cluster.objects.head(output["key"])
        assert head is not None
        assert (head.size, head.sha256) == (output["bytes"], output["sha256"])


def test_a_200_line_batch_runs_within_its_window_with_one_result_per_line(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(KILN_BATCH_WINDOW="16", **FAST_FEEDING)
    cluster.start_worker(SLEEPY_PIPELINE)
    custom_ids = write_batch(tmp_path / "batch.jsonl", 200)
    submit = start_submit(
        cluster,
        tmp_path / "batch.jsonl",
        "--pipeline",
        "sleepy",
        "--wait",
        "--json",
        "--timeout",
        "240",
    )
    batches = BatchStore(cluster.store.redis, cluster.store.settings)
    try:
        batch = the_batch(batches)
        batch, most_live = watch(batches, batch.id, timeout_s=240)
        stdout, stderr = submit.communicate(timeout=60)
    finally:
        submit.kill()
    assert submit.returncode == 0, stderr
    view = json.loads(stdout)
    assert (view["status"], view["outcome"]) == ("completed", "succeeded")
    assert view["counts"]["succeeded"] == 200
    assert 0 < most_live <= 16, most_live  # the window held while feeding
    check_results(cluster, batch.id, custom_ids, tmp_path / "results.jsonl")
    assert all(cluster.completion_count(batch_job_id(batch.id, c)) == 1 for c in custom_ids)


def test_a_refused_file_names_its_lines(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory()
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"custom_id": "a", "prompt": "p"})
        + "\n"
        + json.dumps({"custom_id": "a", "prompt": "p"})
        + "\n"
        + json.dumps({"custom_id": "b", "prompt": "p", "steps": 0})
        + "\n"
    )
    answer = cluster.run_cli("batch", "submit", str(path))
    assert answer.returncode == 2
    assert "line 2, custom_id: duplicate custom_id 'a'" in answer.stderr
    assert "line 3, steps:" in answer.stderr
    assert "2 of 3 lines are invalid" in answer.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_feeder_node_killed_mid_batch_another_takes_over_no_line_skipped_or_fed_twice(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    # the job event streams are read at the end: keep finished lines' records until then
    retention = {"KILN_BATCH_ITEM_RETENTION_S": "3600"}
    # The queued audit and the broker's visibility timeout keep their deployment defaults (300 s,
    # an hour): a message the killed node had popped but not recorded comes back because its
    # lapse makes the audit due at once (tasks/control/audit.py), well within the watch.
    cluster = cluster_factory(KILN_BATCH_WINDOW="8", **FAST_FEEDING, **retention)
    first = cluster.start_worker(SLEEPY_PIPELINE)
    second = cluster.start_worker(SLEEPY_PIPELINE)
    custom_ids = write_batch(tmp_path / "batch.jsonl", 120)
    answer = cluster.run_cli(
        "batch", "submit", str(tmp_path / "batch.jsonl"), "--pipeline", "sleepy"
    )
    assert answer.returncode == 0, answer.stderr
    batch_id = answer.stdout.strip()
    batches = BatchStore(cluster.store.redis, cluster.store.settings)
    feeding = BatchFeeding(cluster.store.redis, cluster.store.settings)
    wait_until(lambda: batches.get_fed(batch_id).fed, lambda fed: fed >= 40, timeout_s=120)
    feeder = feeder_of(feeding, batch_id)
    victim = first if feeder == first.node_id else second
    survivor = second if victim is first else first
    assert feeder == victim.node_id
    victim.kill9()
    try:
        batch, most_live = watch(batches, batch_id, timeout_s=240)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stuck: {stuck_lines(cluster, batch_id, custom_ids)}") from exc
    assert batch.status == "completed"
    assert feeder_of(feeding, batch_id) is None  # released at the end
    assert most_live <= 8
    check_results(cluster, batch_id, custom_ids, tmp_path / "results.jsonl")
    for custom_id in custom_ids:  # every line's job was created exactly once
        job_id = batch_job_id(batch_id, custom_id)
        created = [
            e
            for e in cluster.store.events(job_id)
            if e.type == "queued" and e.payload.get("reason") == "created"
        ]
        assert len(created) == 1, job_id
    assert survivor.process.poll() is None
