"""A queued job's place in line and its expected start (docs/contract.md §3).

The state machine keeps each queue's queued jobs in order (storage: one sorted set per queue), so
the rank of a job is one ZRANK. Its position counts the lane policy of tasks.queue.lanes: a node
takes interactive jobs first but lets one bulk job through after `bulk_share_every` interactive
ones in a row. So a bulk job at rank b waits for the b bulk jobs ahead of it and for at most
`bulk_share_every` interactive jobs before each of those and before itself; an interactive job at
rank r waits for the r interactive jobs ahead and the bulk jobs let through between them. A paused
other lane lets nothing through (unless the job's own queue is paused as well: its position is
then the one it will have once they resume). The expected start is (position + 1) / rate, where
the rate is the runs of the job's pipeline (both lanes) finished per second over the last ten
minutes: each run that ends frees a slot for the next job in line. No rate (nothing finished
lately) or a paused queue: no estimate. A job a node holds (waiting in the node, not started)
is placed by its node's line instead: its position there, at the same rate (a paused queue does
not stop a node from starting what it holds).
"""

from __future__ import annotations

from kiln.common.request import Lane
from kiln.common.states import JobState
from kiln.storage.creation import Placement
from kiln.storage.leases import WAITING_IN_NODE
from kiln.storage.queues import QueueOps, QueueSnapshot
from kiln.storage.records import JobRecord
from kiln.tasks.contract.views import QueueEstimate
from kiln.tasks.queue.lanes import LANES, queue_name


def jobs_ahead(lane: str, rank: int, other_lane_size: int, bulk_share_every: int) -> int:
    """Jobs that start before one at `rank` in its lane's queue, given the other lane's size."""
    if lane == Lane.bulk:
        if bulk_share_every <= 0:
            return rank  # bulk always goes first
        return rank + min(other_lane_size, (rank + 1) * bulk_share_every)
    if bulk_share_every <= 0:
        return rank + other_lane_size
    return rank + min(other_lane_size, rank // bulk_share_every)


def placement(lane: str, queue: str) -> Placement:
    """The queues a snapshot of a job in `queue` (lane `lane`) asks about."""
    pipeline = queue.partition(".")[2]
    other = next((q for q in LANES if q != lane), None)
    return Placement(
        queue=queue,
        other=queue_name(other, pipeline) if other else None,
        rate_queues=[queue_name(each, pipeline) for each in LANES],
    )


def queue_estimate(
    store: QueueOps, record: JobRecord, bulk_share_every: int
) -> QueueEstimate | None:
    """The queued job's position and expected start; None if it is not queued (or predates them).

    A job a node holds (progress `waiting_in_node`) starts after the jobs ahead of it in that
    node's line, whatever the queue holds: its position is its place there.
    """
    if record.state != JobState.QUEUED or not record.queue:
        return None
    where = placement(record.lane, record.queue)
    snapshot = store.queue_snapshot(record.id, where.queue, where.other, where.rate_queues)
    progress = record.progress or {}
    if progress.get("stage") == WAITING_IN_NODE and snapshot.rank is not None:
        return in_node_estimate(snapshot, int(progress.get("position") or 0))
    return estimate_from(snapshot, record.lane, bulk_share_every)


def in_node_estimate(snapshot: QueueSnapshot, position: int) -> QueueEstimate:
    """The estimate of a job waiting in a node at `position` there (no lane interleaves)."""
    rate = snapshot.completion_rate()
    if rate is None:
        return QueueEstimate(position=position)
    return QueueEstimate(position=position, estimated_start_s=round((position + 1) / rate, 1))


def estimate_from(
    snapshot: QueueSnapshot, lane: str, bulk_share_every: int
) -> QueueEstimate | None:
    """The position and expected start a snapshot of a queued job in lane `lane` shows."""
    if snapshot.rank is None:
        return None
    # a paused other lane lets nothing through; while the job's own queue is paused too, the
    # position is the one it will have once they resume
    other_runs = not snapshot.other_paused or snapshot.paused
    waiting_other = snapshot.other_size if other_runs else 0
    position = jobs_ahead(lane, snapshot.rank, waiting_other, bulk_share_every)
    rate = snapshot.completion_rate()
    if snapshot.paused or rate is None:
        return QueueEstimate(position=position)
    return QueueEstimate(position=position, estimated_start_s=round((position + 1) / rate, 1))
