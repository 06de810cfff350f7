"""A node's part of priority preemption (tasks/node/preempted.py) on real Redis.

Its cancel watch stops a running job that a preemption asks for, with `preempted` and the job it
makes room for, only when its run takes step checkpoints (a stop then checkpoints its step); a
job not started, or one whose run takes none, is left running. The message built for the head
of the lane is the one Celery would push on the job's queue.
"""

from __future__ import annotations

from kiln.common.stops import StopReason
from kiln.storage.preemption import PreemptionOps
from kiln.tasks.node.maintenance import watch_cancels
from kiln.tasks.node.preempted import head_of_lane_message
from kiln.tasks.queue.kombu_redis import listed_run_job_id, queue_list_keys
from tests.storage.helpers import new_job
from tests.tasks.node.conftest import NodeFactory

QUEUE = "bulk.tiny"


def test_the_cancel_watch_stops_a_checkpointing_job_a_preemption_asks_for(
    make_node: NodeFactory,
) -> None:
    harness = make_node()
    node, store = harness.node, harness.store
    ops = PreemptionOps(store.redis, store.settings)
    ids = harness.running(3, QUEUE)
    for job_id, _ in ids:
        assert ops.request_preemption(job_id, f"waiting-{job_id}", cap=2, min_run_s=0.0, ttl_s=30.0)
    (checkpointing, token_a), (no_checkpoints, token_b), (held, token_c) = ids
    with (
        node.tracking(checkpointing, token_a) as a,
        node.tracking(no_checkpoints, token_b) as b,
        node.tracking(held, token_c) as c,
    ):
        a.started = a.checkpoints = True
        b.started = True  # its run takes no checkpoints: stopping it would lose its steps
        c.checkpoints = True  # not started: its group never ran it
        watch_cancels(node)
        assert (a.stop_reason, a.preempted_for) == (
            StopReason.PREEMPTED,
            f"waiting-{checkpointing}",
        )
        assert b.stop_reason is None
        assert c.stop_reason is None


def test_the_head_of_lane_message_is_celerys_for_the_jobs_queue(make_node: NodeFactory) -> None:
    harness = make_node()
    record, _ = harness.store.create_job(new_job(lane="bulk", queue=QUEUE))
    built = head_of_lane_message(harness.node, record)
    assert built is not None  # the broker is Kiln's Redis
    key, message = built
    assert key == queue_list_keys(harness.node.celery_app, QUEUE)[0]
    assert listed_run_job_id(message) == record.id


def test_a_delivery_of_a_job_fetched_again_outlives_the_older_ones_end(
    make_node: NodeFactory,
) -> None:
    # a preempted job's message is at the head of its queue: this node may fetch it again while
    # the preempted attempt's delivery is still unwinding; that one's end must not untrack it
    node = make_node().node
    older = node.tracking("job-x", 1)
    older.__enter__()
    newer = node.tracking("job-x", 2)
    tracked = newer.__enter__()
    node.waiting.add("job-x", 2)
    older.__exit__(None, None, None)
    node.waiting.leave("job-x", 1)  # the older delivery's own leave
    assert node.tracked_jobs() == [tracked]  # its lease is still renewed by the heartbeat
    assert len(node.waiting) == 1
    newer.__exit__(None, None, None)
    assert node.tracked_jobs() == []
