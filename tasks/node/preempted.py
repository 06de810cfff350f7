"""A node's part of priority preemption: stop a job at its next step, queue it at the head.

A preemption requested for one of the node's running jobs (the decision: tasks/control/
preemption.py; docs/operations.md §20) stops that job at its next step boundary, checkpointed,
and queues it again at the head of its lane.

The request is the job's stop request, the one a cancel and a pause write (storage/leases.py
`StopRequest`), so the node's cancel watch reads it with them in its one read per tick
(tasks/node/maintenance.py `watch_cancels`); it stops only a running job that takes step
checkpoints (such a job's stop, `StopReason.PREEMPTED`, is one of gpu_worker's
`CHECKPOINTED_STOPS`, so rank 0 checkpoints the very step it stops at); a request for another
lapses: stopping it would throw its steps away. The attempt then ends with `requeue_preempted`
(storage/lua/preempted.lua), which also pushes the job's message where its queue's next fetch
pops first (`head_of_lane_message`: the broker is Kiln's Redis; with another broker the job is
published as usual, at the back of the list, while its place in the queue index is still the
head).
"""

from __future__ import annotations

import logging
import uuid

from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from kiln.storage.job_store import JobRecord
from kiln.storage.preemption import PreemptionOps
from kiln.tasks.node.node import Node
from kiln.tasks.queue.submit import job_queue

log = logging.getLogger(__name__)


def preemption_ops(node: Node) -> PreemptionOps:
    """The preempted run's store, on the node's Redis client (no I/O: one per preempted run)."""
    return PreemptionOps(node.store.redis, node.store.settings)


def head_of_lane_message(node: Node, record: JobRecord) -> tuple[str, str] | None:
    """The job's `run_job` message and its queue's list key, built as Celery would.

    None when the broker is not Kiln's Redis (or the message cannot be built): it is published
    after, as usual.
    """
    messages = node.submitter.messages  # the process's (tasks/queue/process.py)
    if messages is None:
        return None
    try:
        # built whole by Celery (its template, `run_job`, expects no running task: inside this
        # delivery's task Celery names it as the message's parent and root)
        return messages.celery_built(record.id, job_queue(record), str(uuid.uuid4()))
    except (RedisError, OperationalError, OSError, ValueError) as exc:
        log.warning("job %s: its message was not built (%s); published after", record.id, exc)
        return None
