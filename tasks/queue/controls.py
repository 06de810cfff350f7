"""Operator controls of queues and nodes (docs/operations.md §10): pause, resume, purge, drain.

Pauses and drain requests are durable flags in Redis (storage.queues); every node polls them from
its maintenance loop and stops or starts consuming the queues concerned on its own Celery worker.
A purge cancels a queue's queued jobs through the state machine, one by one, each with its
`canceled` event; their Celery messages stay in the broker and are dropped on delivery (the job is
finished). The API's admin routes and `kiln admin` both call these.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from kiln.common.job_events import CanceledReason
from kiln.storage.errors import IllegalTransition, JobNotFound
from kiln.storage.job_store import JobRecord, JobStore
from kiln.storage.queues import QueueOps
from kiln.tasks.contract.schemas import PipelineName
from kiln.tasks.queue.lanes import LANES, queue_name

log = logging.getLogger(__name__)

PURGED: CanceledReason = "purged"  # the `reason` of the `canceled` event of a purged job
_PIPELINE_NAME: TypeAdapter[str] = TypeAdapter(PipelineName)
# jobs read per round while purging: each is one script run
_PURGE_CHUNK = 500


class InvalidQueue(ValueError):
    """Not a queue name: `<lane>.<pipeline>` with a known lane and a valid pipeline name."""


def parse_queue(queue: str) -> tuple[str, str]:
    """`bulk.tiny` → ('bulk', 'tiny'); InvalidQueue for anything else."""
    lane, sep, pipeline = queue.partition(".")
    if not sep or lane not in LANES:
        raise InvalidQueue(
            f"invalid queue {queue!r}: expected <lane>.<pipeline> with lane one of "
            f"{', '.join(LANES)} (e.g. bulk.tiny)"
        )
    try:
        _PIPELINE_NAME.validate_python(pipeline)
    except ValidationError as exc:
        raise InvalidQueue(f"invalid queue {queue!r}: bad pipeline name {pipeline!r}") from exc
    return lane, pipeline


@dataclass(frozen=True)
class QueueState:
    """One queue as an operator sees it."""

    queue: str
    queued: int
    paused: bool
    paused_at: float | None = None
    paused_by: str = ""


def pause(store: QueueOps, queue: str, by: str = "") -> bool:
    """Pause `queue` on every node (durable); True if it was running before."""
    parse_queue(queue)
    paused = store.pause_queue(queue, by=by)
    log.info("queue %s paused by %s", queue, by or "an operator")
    return paused


def resume(store: QueueOps, queue: str) -> bool:
    """Resume `queue` on every node; True if it was paused."""
    parse_queue(queue)
    return store.resume_queue(queue)


def queue_states(store: QueueOps, pipelines: Iterable[str]) -> list[QueueState]:
    """Every queue of `pipelines` (both lanes) and every paused queue, with its queued jobs."""
    paused = store.paused_queues()
    names = {queue_name(lane, p) for p in pipelines for lane in LANES} | set(paused)
    ordered = sorted(names)
    counts = store.queued_counts(ordered)
    return [
        QueueState(
            queue=name,
            queued=counts[name],
            paused=name in paused,
            paused_at=paused.get(name, {}).get("paused_at"),
            paused_by=str(paused.get(name, {}).get("by", "")),
        )
        for name in ordered
    ]


def purge(
    store: JobStore, queue: str, on_canceled: Callable[[JobRecord], object] | None = None
) -> list[str]:
    """Cancel every job queued in `queue` now; returns their ids, in queue order.

    Each becomes `canceled` through the state machine (event reason `purged`); `on_canceled` is
    called with each canceled record (the callers queue its webhook). Running jobs are untouched,
    and so is a job that starts (or is canceled) while the purge runs. Jobs queued after the purge
    began may be left queued.
    """
    parse_queue(queue)
    budget = store.queued_counts([queue])[queue]
    canceled: list[str] = []
    seen = 0
    while seen < budget:
        ids = store.queued_ids(queue, min(_PURGE_CHUNK, budget - seen))
        if not ids:
            break
        moved = 0
        for job_id in ids:
            seen += 1
            try:
                record = store.cancel_queued(job_id, PURGED)
            except (IllegalTransition, JobNotFound):
                continue  # it left the queue meanwhile (started, canceled)
            moved += 1
            canceled.append(job_id)
            if on_canceled is not None:
                on_canceled(record)
        if not moved:
            break  # every entry read moved on by itself: nothing of ours is left to cancel
    log.info("queue %s purged: %d jobs canceled", queue, len(canceled))
    return canceled


def drain(store: QueueOps, node_id: str, exit: bool, by: str = "") -> None:
    """Ask `node_id` to finish its running jobs and take no more; with `exit`, then exit."""
    store.request_drain(node_id, exit=exit, by=by)
    log.info("node %s asked to drain%s", node_id, " and exit" if exit else "")


def undrain(store: QueueOps, node_id: str) -> bool:
    """Withdraw a drain request: a node still up takes jobs again; True if there was one."""
    return store.withdraw_drain(node_id)
