"""A node's part of priority preemption: stop a job at its next step, queue it at the head.

A preemption requested for one of the node's running jobs (the decision: tasks/control/
preemption.py; docs/operations.md §20) stops that job at its next step boundary, checkpointed,
and queues it again at the head of its lane.

The node reads the requests with its cancel watch (`watch_preemptions`, one pipelined read for
its running jobs that take step checkpoints); such a job's stop (`StopReason.PREEMPTED`) is one of
gpu_worker's `CHECKPOINTED_STOPS`, so rank 0 checkpoints the very step it stops at. A request for
a job whose run takes no checkpoints is never read (it lapses): stopping it would throw its steps
away. The attempt then ends with `requeue_preempted` (storage/lua/preempted.lua), which also
pushes the job's message where its queue's next fetch pops first (`head_of_lane_message`: the
broker is Kiln's Redis; with another broker the job is published as usual, at the back of the
list, while its place in the queue index is still the head).
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref

from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from kiln.common.stops import StopReason
from kiln.storage.job_store import JobRecord
from kiln.storage.preemption import PreemptionOps
from kiln.tasks.node.node import Node
from kiln.tasks.queue.messages import CeleryMessages
from kiln.tasks.queue.submit import job_queue

log = logging.getLogger(__name__)

_lock = threading.Lock()
_ops: weakref.WeakKeyDictionary[Node, PreemptionOps] = weakref.WeakKeyDictionary()
_messages: weakref.WeakKeyDictionary[Node, CeleryMessages | None] = weakref.WeakKeyDictionary()


def preemption_ops(node: Node) -> PreemptionOps:
    """The node's store for preemptions (on its Redis client), made once."""
    with _lock:
        ops = _ops.get(node)
        if ops is None:
            ops = _ops[node] = PreemptionOps(node.store.redis, node.store.settings)
        return ops


def watch_preemptions(node: Node) -> None:
    """Stop the running jobs a preemption was requested for, at their next step."""
    running = {t.job_id: t for t in node.running_jobs() if t.stop_reason is None and t.checkpoints}
    if not running:
        return
    for job_id, for_job in preemption_ops(node).preemptions_requested(list(running)).items():
        tracked = running[job_id]
        tracked.preempted_for = for_job
        tracked.stop_reason = StopReason.PREEMPTED
        log.info("job %s: preempted for job %s, stops at its next step", job_id, for_job)


def head_of_lane_message(node: Node, record: JobRecord) -> tuple[str, str] | None:
    """The job's `run_job` message and its queue's list key, built as Celery would.

    None when the broker is not Kiln's Redis (or the message cannot be built): it is published
    after, as usual.
    """
    with _lock:
        if node not in _messages:
            usable = CeleryMessages.usable_for(node.settings, node.storage_settings)
            _messages[node] = CeleryMessages(node.celery_app) if usable else None
        messages = _messages[node]
    if messages is None:
        return None
    try:
        # built whole by Celery (its template, `run_job`, expects no running task: inside this
        # delivery's task Celery names it as the message's parent and root)
        return messages.celery_built(record.id, job_queue(record), str(uuid.uuid4()))
    except (RedisError, OperationalError, OSError, ValueError) as exc:
        log.warning("job %s: its message was not built (%s); published after", record.id, exc)
        return None
