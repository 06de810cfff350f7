"""The jobs a node holds that its group has not started: still `queued`, waiting in the node.

A delivery holds its job's lease (storage `hold`) and hands the request to the group, which
starts it when a batch takes it (the attempt's start: queued → running, fenced). Meanwhile the
job's progress says where it waits: `waiting_in_node` with the node id and its position there
(the jobs the node holds ahead of it, oldest first). Positions move up as jobs ahead start or
leave; each change is written through the progress writer (fenced by each job's lease token).
"""

from __future__ import annotations

import threading

from kiln.storage.leases import waiting_progress
from kiln.tasks.node.progress_writer import PendingProgress, ProgressWriter
from kiln.tasks.webhooks.event_sink import EventSink


class WaitingInNode:
    """Job id -> lease token of each held, not yet started job, in the order they were held."""

    def __init__(self, node_id: str, progress: ProgressWriter, events: EventSink) -> None:
        self.node_id = node_id
        self.progress = progress
        self.events = events
        self._lock = threading.Lock()
        self._jobs: dict[str, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def next_position(self) -> int:
        """The position a job held now takes: behind every job waiting here."""
        return len(self)

    def add(self, job_id: str, lease_token: int) -> None:
        """A job was held (its progress names its position already)."""
        with self._lock:
            self._jobs[job_id] = lease_token

    def leave(self, job_id: str, lease_token: int | None = None) -> None:
        """A job started or left the node: the jobs behind it move up (each position written).

        `lease_token`: only the delivery holding it under that token leaves (another delivery of
        the same job may wait here already: a preempted job's, fetched again at once).
        """
        with self._lock:
            if job_id not in self._jobs or lease_token not in (None, self._jobs[job_id]):
                return
            order = list(self._jobs)
            at = order.index(job_id)
            del self._jobs[job_id]
            moved = [(each, self._jobs[each], p) for p, each in enumerate(order[at + 1 :], at)]
        for each, token, position in moved:
            waiting = waiting_progress(self.node_id, position)
            pending = PendingProgress(self.events.job(each, token), waiting)
            self.progress.update(each, pending, urgent=True)
