"""Messages a dead node held come back long before the visibility timeout (an hour).

tests/e2e/test_recovery.py kills a node holding a message it listed. Here: a node killed after
kombu took a message and before the node listed it (kombu records a delivery as unacknowledged
before the consumer callback runs; a live node's sweeper finds it in kombu's unacked index
around the dead node's lapse: tasks/control/unacked.py), and a node restarted under the same
--node-id, whose first write must not erase what its previous life held
(storage/lua/held_record.lua).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest

from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.app import transport_options
from kiln.tasks.queue.submit import Submitter, job_queue
from tests.e2e.cluster import REPO_ROOT, SLEEPY, Cluster, WorkerProcess
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLEEPY_PIPELINE = f"sleepy={SLEEPY}"
FAST_STEPS = {"KILN_TEST_STEP_SECONDS": "0.01"}


def start_node(
    cluster: Cluster,
    node_id: str | None = None,
    module: str = "kiln.tasks.cli",
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """A `kiln worker` node serving the sleepy pipeline, run as `python -m module`."""
    node_id = node_id or f"node-{uuid.uuid4().hex[:8]}"
    args = [sys.executable, "-m", module, "worker", "--devices", "cpu:1", "--node-id", node_id]
    args += ["--max-batch", "4", "--pipeline", SLEEPY_PIPELINE]
    log_path = cluster.tmp / f"{node_id}-{uuid.uuid4().hex[:4]}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args,
            env={**cluster.env, **FAST_STEPS, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )
    worker = WorkerProcess(process, node_id, log_path, cluster.store)
    cluster.workers.append(worker)
    worker.wait_ready()
    return worker


def test_node_killed_before_listing_a_delivery_does_not_stall_its_job(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    # a real node that exits as its strategy is about to list its first message
    dying = start_node(cluster, module="tests.e2e.dies_before_listing")
    job_id = cluster.submit(pipeline="sleepy", prompt="x", width=64, height=64, steps=2)
    assert dying.process.wait(60) == 137, dying.log()

    # The state the gap leaves: kombu holds the delivery, no list names it, the queue is empty.
    options = transport_options(cluster.settings, cluster.storage_settings.redis_namespace)
    prefix = str(options["global_keyprefix"])
    redis = cluster.store.redis
    dead_delivery = [v for v in redis.hvals(f"{prefix}unacked") if job_id in v]
    assert dead_delivery, "kombu never recorded the delivery"
    assert job_id not in (redis.hget(cluster.store.keys.held_deliveries, dying.node_id) or "")
    assert redis.llen(prefix + job_queue(cluster.store.get(job_id))) == 0
    assert str(cluster.store.get(job_id).state) == "queued"

    cluster.start_worker(SLEEPY_PIPELINE, extra_env=FAST_STEPS)
    started = time.monotonic()
    # far below the 3600 s visibility timeout: the survivor's sweeper published the job again
    finished = cluster.wait_for(job_id, timeout_s=60)
    took_s = time.monotonic() - started
    assert str(finished.state) == "succeeded", finished.error
    assert finished.attempts == 1
    assert cluster.completion_count(job_id) == 1
    print(f"recovered {took_s:.1f}s after the survivor was ready")


def test_node_restarted_under_its_id_gets_back_what_it_held(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # One node, restarted by its supervisor under the same --node-id (compose does so): no other
    # node claims its lapsed list, and its new life writes under that id at once.
    cluster = cluster_factory()
    node_id = f"node-{uuid.uuid4().hex[:8]}"
    holder = start_node(cluster, node_id, env={"KILN_LEASE_BUSY_DELAY_S": "600"})
    unpublished = Submitter(cluster.store, cluster.settings, lambda *_: None)
    record, _ = Intake(unpublished, None).submit(
        JobRequest(pipeline="sleepy", prompt="x", width=64, height=64, steps=2)
    )
    ghost = cluster.store.acquire_lease(record.id, "ghost/1")
    cluster.submitter.publish(record)  # delivered to the holder: lease busy, held for 600 s
    held = cluster.store.keys.held_deliveries
    wait_until(
        lambda: cluster.store.redis.hget(held, node_id) or "",
        lambda listed: record.id in listed,
        timeout_s=60,
    )
    cluster.store.release_lease(record.id, ghost)
    holder.kill9()
    start_node(cluster, node_id)
    # far below the 600 s countdown and the 3600 s visibility timeout
    finished = cluster.wait_for(record.id, timeout_s=60)
    assert str(finished.state) == "succeeded", finished.error
    assert finished.attempts == 1
    assert cluster.completion_count(record.id) == 1
