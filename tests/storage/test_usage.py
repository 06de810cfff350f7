"""The ledger in storage: what the transition that closes an attempt writes, and its totals.

It writes the job's `ledger` and the hour's usage bucket (storage/lua/_machine.lua
`account_usage`), which `usage_totals` reads.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from kiln.common.accounting import AttemptSteps
from kiln.common.ledger import USAGE_BUCKET_S, USAGE_RETENTION_S, AttemptUsage, JobLedger
from kiln.common.states import JobState
from kiln.storage.counters import finished_counts
from kiln.storage.job_store import JobStore
from kiln.storage.usage import add_node_usage, usage_bucket, usage_totals
from tests.storage.helpers import WORKER, lapse_lease, new_job

HANDED_BACK = {"type": "handed_back", "message": "the node shut down", "retryable": True}


def run(store: JobStore, job_id: str) -> int:
    token = store.acquire_lease(job_id, WORKER)
    store.start(job_id, token, node_id="node-1")
    return token


def steps(pipeline: str, gpu_s: float, energy_j: float | None = None, **phases: float) -> Any:
    usage = AttemptUsage(pipeline=pipeline, gpu_s=gpu_s, energy_j=energy_j, **phases)
    return AttemptSteps(0, 4, 0.1, usage=usage.as_dict())


def _log(store: JobStore, job_id: str) -> list[dict[str, Any]]:
    return list(json.loads(store.redis.hget(store.keys.job(job_id), "attempt_log") or "[]"))


def test_each_attempt_adds_its_figures_to_the_job_s_ledger_and_the_hour_s_bucket(
    job_store: JobStore,
) -> None:
    job_id = job_store.create_job(new_job(owner="key-a"))[0].id
    token = run(job_store, job_id)
    job_store.requeue(job_id, token, HANDED_BACK, steps("tiny", 1.5, None, computing_s=0.75))
    token = run(job_store, job_id)
    usage = steps("tiny", 2.25, None, loading_s=0.5, computing_s=1.0, encoding_s=0.2)
    record = job_store.succeed(job_id, token, [{"key": "k"}], {}, usage)

    assert record.state == JobState.SUCCEEDED
    ledger = record.ledger
    assert (ledger.gpu_s, ledger.computing_s, ledger.loading_s) == (3.75, 1.75, 0.5)
    assert (ledger.encoding_s, ledger.uploading_s, ledger.energy_j) == (0.2, 0.0, None)
    assert ledger.queued_s >= 0.0
    assert [entry["gpu_s"] for entry in _log(job_store, job_id)] == [1.5, 2.25]
    now = time.time()
    totals = usage_totals(job_store, now - 3600, now + 1, "key")
    ((row,),) = [totals.rows]
    assert (row.key_id, row.gpu_s, row.attempts, row.energy_j) == ("key-a", 3.75, 2, None)
    counted = finished_counts(job_store).gpu
    assert counted[("tiny", "key-a")] == pytest.approx(3.75)


def test_the_bucket_is_the_hour_s_and_expires_after_the_retention(job_store: JobStore) -> None:
    job_id = job_store.create_job(new_job(owner="key-a"))[0].id
    token = run(job_store, job_id)
    job_store.fail(job_id, token, {"type": "Boom", "retryable": False}, steps=steps("tiny", 1.0))
    hour = int(time.time() // USAGE_BUCKET_S) * USAGE_BUCKET_S
    bucket = usage_bucket(job_store, hour)
    assert job_store.redis.hget(bucket, "key-a/tiny/gpu_s") == "1"
    assert 0 < job_store.redis.ttl(bucket) <= USAGE_RETENTION_S
    # another hour's range reads another bucket: none of this
    assert usage_totals(job_store, hour - 7200, hour - 3600, "key").rows == []


def test_keys_see_their_own_and_pipelines_are_summed_over_keys(job_store: JobStore) -> None:
    for owner, pipeline, gpu_s, energy in (
        ("key-a", "tiny", 1.0, 10.0),
        ("key-a", "video", 2.0, None),
        ("key-b", "tiny", 4.0, 30.0),
    ):
        job_id = job_store.create_job(new_job(owner=owner))[0].id
        token = run(job_store, job_id)
        job_store.succeed(job_id, token, [{"key": "k"}], {}, steps(pipeline, gpu_s, energy))
    add_node_usage(job_store, "node-1", held_gpu_s=10.0, busy_gpu_s=7.0)
    now = time.time()

    by_key = usage_totals(job_store, now - 60, now + 1, "key")
    assert [(r.key_id, r.gpu_s, r.energy_j) for r in by_key.rows] == [
        ("key-a", 3.0, 10.0),
        ("key-b", 4.0, 30.0),
    ]
    ((node,),) = [by_key.nodes]
    assert (node.node_id, node.held_gpu_s, node.busy_gpu_s, node.idle_gpu_s) == (
        "node-1",
        10.0,
        7.0,
        3.0,
    )
    by_pipeline = usage_totals(job_store, now - 60, now + 1, "pipeline")
    assert [(r.pipeline, r.gpu_s, r.attempts) for r in by_pipeline.rows] == [
        ("tiny", 5.0, 2),
        ("video", 2.0, 1),
    ]
    own = usage_totals(job_store, now - 60, now + 1, "pipeline", owner="key-b")
    assert [(r.pipeline, r.gpu_s) for r in own.rows] == [("tiny", 4.0)]
    assert own.nodes == []  # a key's view holds no node


def test_a_dead_node_s_attempt_adds_only_its_wait(job_store: JobStore) -> None:
    job_id = job_store.create_job(new_job(owner="key-a"))[0].id
    run(job_store, job_id)
    lapse_lease(job_store, job_id)
    assert job_store.reap(job_id)
    record = job_store.get(job_id)
    assert record.ledger.gpu_s == 0.0
    assert record.ledger.queued_s >= 0.0
    now = time.time()
    assert usage_totals(job_store, now - 60, now + 1, "key").rows == []


def test_a_job_that_never_ran_has_a_zero_ledger(job_store: JobStore) -> None:
    record = job_store.create_job(new_job())[0]
    assert job_store.get(record.id).ledger == JobLedger()
