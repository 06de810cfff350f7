"""After a batch's cancel answers, no line of it starts: real node workers, the feeder in them.

The cancel sets the batch's stop in one step (batch_stop.lua); a node holds a job (hold.lua) and
starts it (transition.lua), each refusing a job of a stopped batch: all run on the Redis clock,
so every job's `started_at` and `running` event come before the batch's `stopped_at`. The feeder's
wind-down is made slow (a long feed interval) so that, without the fence, the node starts queued
lines of the canceled batch long before they are canceled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchStore
from kiln.tasks.batches.intake import batch_job_id
from tests.e2e.cluster import Cluster
from tests.e2e.test_batches import SLEEPY_PIPELINE, watch, write_batch
from tests.waiting import wait_until


def test_no_line_starts_after_the_cancel_answered(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(
        KILN_BATCH_WINDOW="16",
        KILN_BATCH_FEED_INTERVAL_S="3",  # the wind-down comes seconds after the cancel
        KILN_BATCH_RESULTS_FLUSH_S="0.5",
        KILN_BATCH_ITEM_RETENTION_S="3600",  # the records are read at the end
        # Long enough that the window (16 lines, 4 at a time, 3 steps) is still running when the
        # test sees two lines succeed, even on a starved machine: at 0.05 s a whole window once
        # finished before the test looked, and nothing was left open to fence.
        KILN_TEST_STEP_SECONDS="0.3",
    )
    cluster.start_worker(SLEEPY_PIPELINE)
    custom_ids = write_batch(tmp_path / "batch.jsonl", 40, steps=3)
    answer = cluster.run_cli(
        "batch", "submit", str(tmp_path / "batch.jsonl"), "--pipeline", "sleepy"
    )
    assert answer.returncode == 0, answer.stderr
    batch_id = answer.stdout.strip()
    job_ids = [batch_job_id(batch_id, custom_id) for custom_id in custom_ids]
    batches = BatchStore(cluster.store.redis, cluster.store.settings)
    wait_until(  # it runs: cancel now
        lambda: batches.get_fed(batch_id).counts[JobState.SUCCEEDED],
        lambda succeeded: succeeded >= 2,
        timeout_s=120,
        poll_s=0.02,
    )
    canceled = batches.stop_batch(batch_id, "canceled")  # what the API's cancel does
    stopped_at = float(
        cluster.store.redis.hget(cluster.store.keys.batch(batch_id), "stopped_at") or 0
    )
    assert canceled.stop == "canceled"
    batch, _ = watch(batches, batch_id, timeout_s=120)  # the positive signal: it has ended
    assert batch.status == "canceled"
    late: list[str] = []
    for record in cluster.store.get_many(job_ids):
        if record is None:
            continue  # never fed
        starts = [e.time for e in cluster.store.events(record.id) if e.type == "running"]
        if any(start > stopped_at for start in starts):
            late.append(f"{record.id}: started {max(starts) - stopped_at:.3f}s after the cancel")
    assert late == [], late
    assert batch.counts[JobState.CANCELED] > 0  # lines were still open when it was canceled
