"""The ledger on real nodes: every job's GPU-seconds plus the nodes' idle add up to the nodes' own.

Two real nodes on real Redis and a real local object store, each with its own worker group (one
CPU rank, the tiny image pipeline, batches of up to 4 outputs). Jobs of one and of two outputs
run at once, so the groups batch them and share each forward's seconds by work
(kiln/common/ledger.py); the jobs' records, the usage buckets and the nodes' counters must agree.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kiln.common.states import JobState
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.counters import GroupCounters
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.settings import StorageSettings
from kiln.storage.usage import usage_totals
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.jobs import JobRunner
from kiln.tasks.node.node import Node
from kiln.tasks.queue.process import ProcessParts
from tests.waiting import GENEROUS_S

PIPELINE = "tiny"
JOBS_PER_NODE = 6


@pytest.fixture
def nodes(storage_settings: StorageSettings) -> Iterator[list[Node]]:
    made = []
    for name in ("a", "b"):
        config = GroupConfig(
            devices=["cpu:1"],
            pipelines={PIPELINE: PIPELINE},
            cpu_threads_per_rank=1,
            max_batch=4,
            batch_window_s=0.3,  # jobs submitted together share forwards
        )
        node = Node(
            config,
            ProcessParts(storage_settings=storage_settings),
            node_id=f"node-{name}",
            publish=lambda *_args, **_kwargs: None,
        )
        node.start()
        made.append(node)
    yield made
    for node in made:
        node.shutdown()
        node.celery_app.close()
        node.store.redis.close()


def new_job(store: JobStore, outputs: int) -> str:
    request = JobRequest(
        pipeline=PIPELINE,
        prompt="a kiln",
        width=64,
        height=64,
        steps=4,
        seed=3,
        num_outputs=outputs,
    )
    job_id = uuid.uuid4().hex
    store.create_job(NewJob(id=job_id, request=request.to_record(), owner="key-a"))
    return job_id


def counters(node: Node) -> GroupCounters:
    read = node.coordinator.counters  # type: ignore[attr-defined]
    counted = read()
    assert isinstance(counted, GroupCounters)
    return counted


def test_jobs_gpu_seconds_and_the_nodes_idle_add_up_to_the_nodes_totals(
    nodes: list[Node], job_store: JobStore
) -> None:
    started = time.time()
    runs: list[threading.Thread] = []
    job_ids: list[str] = []
    for node in nodes:
        for index in range(JOBS_PER_NODE):
            job_id = new_job(job_store, 1 + index % 2)
            job_ids.append(job_id)
            runs.append(threading.Thread(target=JobRunner(node, job_id).run))
    for run in runs:
        run.start()
    for run in runs:
        run.join(GENEROUS_S)
    records = [job_store.get(job_id) for job_id in job_ids]
    assert all(r.state == JobState.SUCCEEDED for r in records), [r.error for r in records]
    for node in nodes:
        node.report_usage()  # what the heartbeat does; the test does not wait for one
    totals = [counters(node) for node in nodes]
    # the groups batched: some forward ran more than one output, so shares were split
    assert any(size > 1 for c in totals for size in c.batch_sizes)

    jobs_gpu_s = math.fsum(r.ledger.gpu_s for r in records)
    held = math.fsum(c.held_gpu_s for c in totals)
    idle = math.fsum(c.idle_gpu_s for c in totals)
    assert jobs_gpu_s > 0
    assert idle > 0
    assert jobs_gpu_s + idle == pytest.approx(held, rel=0.01)
    for node in nodes:  # the node's own metrics say the same
        sample = node.metrics.registry.get_sample_value
        labels = {"node_id": node.node_id}
        node_idle = sample("kiln_node_idle_gpu_seconds_total", labels)
        assert node_idle is not None
        assert 0 < node_idle < (sample("kiln_node_gpu_seconds_total", labels) or 0)
    # each job ran a forward (no NVML here: no energy)
    assert all(r.ledger.computing_s > 0 and r.ledger.energy_j is None for r in records)

    # the usage buckets say the same: the key's GPU-seconds plus the nodes' idle are their held
    usage = usage_totals(job_store, started - 1, time.time() + 1, "key")
    ((row,),) = [usage.rows]
    assert (row.key_id, row.attempts) == ("key-a", len(job_ids))
    assert row.gpu_s == pytest.approx(jobs_gpu_s, rel=1e-6)
    node_held = math.fsum(n.held_gpu_s for n in usage.nodes)
    node_idle = math.fsum(n.idle_gpu_s for n in usage.nodes)
    assert [n.node_id for n in usage.nodes] == ["node-a", "node-b"]
    assert row.gpu_s + node_idle == pytest.approx(node_held, rel=0.01)
