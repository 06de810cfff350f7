"""The ledger over many jobs on two nodes: jobs' GPU-seconds + idle = the nodes' own (a script).

    .venv/bin/python tests/benchmarks/bench_ledger.py [--jobs 200] [--at-once 8] [--redis URL]

Two real in-process nodes on real Redis and a local object store (tests/tasks/node/
test_ledger_nodes.py's setup), each a group of one CPU rank serving the tiny image pipeline with
batches of up to 4 outputs. `--jobs` jobs of 1 or 2 outputs (owned by two keys) run `--at-once`
per node at a time, so the groups batch them; the nodes then report their usage as a heartbeat
does. Prints, from the jobs' records, the usage buckets (two keys' rows) and the nodes' own
counters: the jobs' GPU-seconds, the nodes' held, busy and idle GPU-seconds, and how far
jobs + idle are from held (docs/operations.md §21 has a run's figures).
"""

from __future__ import annotations

import argparse
import math
import secrets
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.counters import GroupCounters
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.settings import StorageSettings
from kiln.storage.usage import usage_totals
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.jobs import JobRunner
from kiln.tasks.node.node import Node
from kiln.tasks.queue.process import ProcessParts
from tests.conftest import delete_namespace

PIPELINE = "tiny"
KEYS = ("key-a", "key-b")


def start_node(name: str, settings: StorageSettings) -> Node:
    """A node of one CPU rank batching up to 4 outputs."""
    config = GroupConfig(
        devices=["cpu:1"],
        pipelines={PIPELINE: PIPELINE},
        cpu_threads_per_rank=1,
        max_batch=4,
        batch_window_s=0.2,
    )
    node = Node(config, ProcessParts(storage_settings=settings), node_id=f"node-{name}")
    node.start()
    return node


def new_job(store: JobStore, index: int) -> str:
    """Job `index`: 1 or 2 outputs, owned by one of two keys."""
    request = JobRequest(
        pipeline=PIPELINE,
        prompt=f"a kiln {index}",
        width=64,
        height=64,
        steps=4,
        seed=index,
        num_outputs=1 + index % 2,
    )
    job_id = uuid.uuid4().hex
    owner = KEYS[index // 2 % 2]
    store.create_job(NewJob(id=job_id, request=request.to_record(), owner=owner))
    return job_id


def run_on(node: Node, job_ids: list[str], at_once: int) -> None:
    """Run the node's jobs, `at_once` at a time (each on its own thread, as deliveries are)."""
    for start in range(0, len(job_ids), at_once):
        runs = [
            threading.Thread(target=JobRunner(node, job_id).run)
            for job_id in job_ids[start : start + at_once]
        ]
        for run in runs:
            run.start()
        for run in runs:
            run.join()


def counters(node: Node) -> GroupCounters:
    read = node.coordinator.counters  # type: ignore[attr-defined]
    counted = read()
    assert isinstance(counted, GroupCounters)
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--at-once", type=int, default=8, help="jobs running per node at once")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    namespace = f"kiln-bench-ledger-{secrets.token_hex(4)}"
    with tempfile.TemporaryDirectory() as outputs:
        settings = StorageSettings(
            redis_url=args.redis, redis_namespace=namespace, storage_url=f"file://{outputs}"
        )
        store = JobStore.from_settings(settings)
        nodes = [start_node(name, settings) for name in ("a", "b")]
        try:
            measure(store, nodes, args.jobs, args.at_once)
        finally:
            for node in nodes:
                node.shutdown()
                node.celery_app.close()
                node.store.redis.close()
            store.redis.close()
            delete_namespace(args.redis, namespace)


def measure(store: JobStore, nodes: list[Node], jobs: int, at_once: int) -> None:
    started = time.time()
    job_ids = [new_job(store, index) for index in range(jobs)]
    halves = [job_ids[0::2], job_ids[1::2]]
    clock = time.monotonic()
    runs = [
        threading.Thread(target=run_on, args=(node, half, at_once))
        for node, half in zip(nodes, halves, strict=True)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    wall = time.monotonic() - clock
    for node in nodes:
        node.report_usage()
    records = [store.get(job_id) for job_id in job_ids]
    states = {str(r.state) for r in records}
    totals = [counters(node) for node in nodes]
    jobs_gpu_s = math.fsum(r.ledger.gpu_s for r in records)
    held = math.fsum(c.held_gpu_s for c in totals)
    busy = math.fsum(c.busy_gpu_s for c in totals)
    idle = math.fsum(c.idle_gpu_s for c in totals)
    sizes: dict[int, int] = {}
    for c in totals:
        for size, count in c.batch_sizes.items():
            sizes[size] = sizes.get(size, 0) + count
    print(f"{jobs} jobs on 2 nodes in {wall:.1f} s; states {sorted(states)}")
    print(f"forwards by outputs per forward: {dict(sorted(sizes.items()))}")
    print(f"records: jobs' GPU-seconds {jobs_gpu_s:.3f}")
    print(f"nodes' counters: held {held:.3f}, busy {busy:.3f}, idle {idle:.3f} GPU-seconds")
    # idle is held - busy by definition: the check is that the charges the jobs' records hold,
    # written through their transitions, add up to the busy GPU-seconds the groups measured
    charged_gap = (jobs_gpu_s - busy) / busy
    print(f"jobs' GPU-seconds vs the groups' busy: {charged_gap * 1e6:+.2f} ppm")
    gap = (jobs_gpu_s + idle - held) / held
    print(f"jobs + idle = {jobs_gpu_s + idle:.3f} vs held {held:.3f}: {gap * 100:+.4f} %")
    usage = usage_totals(store, started - 1, time.time() + 1, "key")
    per_key = {row.key_id: row for row in usage.rows}
    for key in KEYS:
        from_records = math.fsum(r.ledger.gpu_s for r in records if r.owner == key)
        row = per_key[key]
        print(
            f"usage {key}: {row.gpu_s:.3f} GPU-seconds, {row.attempts} attempts "
            f"(records: {from_records:.3f})"
        )
    bucket_idle = math.fsum(n.idle_gpu_s for n in usage.nodes)
    bucket_held = math.fsum(n.held_gpu_s for n in usage.nodes)
    bucket_jobs = math.fsum(row.gpu_s for row in usage.rows)
    bucket_gap = (bucket_jobs + bucket_idle - bucket_held) / bucket_held
    print(
        f"usage buckets: jobs {bucket_jobs:.3f} + idle {bucket_idle:.3f} vs held "
        f"{bucket_held:.3f}: {bucket_gap * 100:+.4f} %"
    )


if __name__ == "__main__":
    main()
