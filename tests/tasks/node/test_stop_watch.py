"""The node's cancel watch reads every stop request in one command per tick, on real Redis.

A cancel, a pause and a priority preemption are one stop request per running job (storage/
leases.py); the watch's tick (the node's `cancels` component, every 20 ms) reads all of its
tracked jobs' requests with one command, whatever they ask. What Redis ran is read back with
MONITOR, filtered to the test's namespace (the test Redis is shared). The node's heartbeat says
which stop requests its watch reads, so the control loop asks a preemption only of a node that
reads it as one (a node of an earlier release read it as a cancel).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import redis

from kiln.common.stops import StopReason
from kiln.storage.job_store import JobStore
from kiln.storage.preemption import PreemptionOps
from kiln.tasks.control.preemption import Preemption, preempt_for_late_jobs
from kiln.tasks.node.maintenance import heartbeat, node_components, node_context, watch_cancels
from tests.storage.helpers import new_job
from tests.tasks.node.conftest import NodeFactory

QUEUE = "bulk.tiny"


def commands_during(store: JobStore, act: Callable[[], object]) -> list[list[str]]:
    """The commands clients sent on the test namespace's keys while `act` ran, in order.

    A script's own calls are left out (the client sent one EVALSHA). The end is a marker the
    test's store sends after `act`: MONITOR shows commands in the order Redis ran them, so every
    command `act` sent comes before it.
    """
    namespace = store.settings.redis_namespace
    marker = f"{namespace}:monitor-marker"
    client = redis.Redis.from_url(store.settings.redis_url, decode_responses=True)
    seen: list[list[str]] = []
    try:
        with client.monitor() as monitor:
            act()
            store.redis.exists(marker)
            while True:
                command = monitor.next_command()
                words = command["command"].split(" ")
                if words == ["EXISTS", marker]:
                    return seen
                if command["client_type"] != "lua" and any(namespace in w for w in words):
                    seen.append(words)
    finally:
        client.close()


def test_one_command_per_tick_reads_cancels_pauses_and_preemptions(
    make_node: NodeFactory,
) -> None:
    harness = make_node()
    node, store = harness.node, harness.store
    (watch,) = [c for c in node_components(node, None) if c.name == "cancels"]
    ids = harness.running(4, QUEUE)
    preempted, canceled, paused, left = (job_id for job_id, _ in ids)
    stop_keys = [store.keys.cancel(job_id) for job_id, _ in ids]
    with ExitStack() as held:
        tracked = {
            job_id: held.enter_context(node.tracking(job_id, token)) for job_id, token in ids
        }
        for job in tracked.values():
            job.started = job.checkpoints = True  # a stop checkpoints its step: preemptible

        # nothing asked: one read of the four requests
        assert commands_during(store, watch.step) == [["MGET", *stop_keys]]
        assert all(job.stop_reason is None for job in tracked.values())

        ops = PreemptionOps(store.redis, store.settings)
        assert ops.request_preemption(preempted, "waiting-1", cap=2, min_run_s=0.0, ttl_s=30.0)
        store.cancel(canceled)
        store.pause(paused)
        # each asked something else: still one read, and each job stops for what it was asked
        assert commands_during(store, watch.step) == [["MGET", *stop_keys]]
        assert (tracked[preempted].stop_reason, tracked[preempted].preempted_for) == (
            StopReason.PREEMPTED,
            "waiting-1",
        )
        assert tracked[canceled].stop_reason == StopReason.CANCELED
        assert tracked[paused].stop_reason == StopReason.PAUSED
        assert tracked[left].stop_reason is None
        # the jobs told to stop are not read again
        assert commands_during(store, watch.step) == [["MGET", store.keys.cancel(left)]]


def test_a_nodes_heartbeat_offers_its_jobs_and_its_watch_carries_the_decision_out(
    make_node: NodeFactory,
) -> None:
    # the whole path on one node: its heartbeat lists what its watch reads and the jobs a
    # preemption may suspend, its control loop decides, its cancel watch stops the job
    harness = make_node(target_start_s_interactive=30.0, priority_preemption_min_run_s=0.0)
    node, store = harness.node, harness.store
    record, _ = store.create_job(new_job(lane="bulk", queue=QUEUE))
    token = store.acquire_lease(record.id, f"{node.node_id}/delivery-{record.id}")
    store.start(record.id, token)
    late, _ = store.create_job(new_job(lane="interactive", queue="interactive.tiny"))
    store.redis.hset(store.keys.job(late.id), "created_at", store.redis_now() - 3600)
    with node.tracking(record.id, token) as tracked:
        tracked.started = tracked.checkpoints = True
        heartbeat(node)
        (info,) = store.live_nodes()
        assert info["stops_read"] == ["canceled", "paused", "preempted"]
        assert info["checkpointing_jobs"] == [record.id]

        asked = preempt_for_late_jobs(node_context(node), ["interactive.tiny", QUEUE])

        assert asked == [Preemption(record.id, node.node_id, late.id)]
        watch_cancels(node)
        assert (tracked.stop_reason, tracked.preempted_for) == (StopReason.PREEMPTED, late.id)
