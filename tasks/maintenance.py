"""A node's background loops: lease heartbeat + node health, reaper, sweeper.

They run on their own threads so that a long compute step never starves lease renewal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from storage.errors import StorageError
from tasks.node import Node, StopReason

log = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 60.0
# A cancel must land within a denoising step; one pipelined read per poll is cheap.
CANCEL_POLL_S = 0.02


def renew_leases(node: Node) -> None:
    """Renew every held lease; a job whose lease is gone is told to stop."""
    for tracked in node.tracked_jobs():
        if not node.store.renew_lease(tracked.job_id, tracked.lease_token):
            log.warning("lease of job %s was lost; stopping it", tracked.job_id)
            tracked.stop_reason = StopReason.LEASE_LOST


def heartbeat(node: Node) -> None:
    """One heartbeat: leases first (they matter most), then the node's health record."""
    renew_leases(node)
    ttl = max(3.0 * node.settings.heartbeat_interval_s, 5.0)
    node.store.publish_node(node.node_id, node.health(), ttl)


def reap_expired(node: Node) -> int:
    """Re-queue and re-publish jobs whose lease expired while running; returns how many."""
    reaped = 0
    for job_id in node.store.expired_leases():
        if node.store.reap(job_id):
            node.submitter.publish(node.store.get(job_id))
            reaped += 1
            log.info("reaped job %s (its lease expired while running)", job_id)
    return reaped


def watch_cancels(node: Node) -> None:
    """Tell running jobs whose cancel was requested to stop (one pipelined read for all)."""
    running = {t.job_id: t for t in node.tracked_jobs() if t.stop_reason is None}
    for job_id in node.store.cancels_requested(list(running)):
        running[job_id].stop_reason = StopReason.CANCELED


def prune_indexes(node: Node) -> int:
    """Drop index entries of finished jobs whose records have expired (retention)."""
    return node.store.prune_indexes()


def sweep_unpublished(node: Node) -> int:
    """Publish queued records whose publish was never confirmed; returns how many."""
    job_ids = node.store.unpublished_jobs(node.settings.sweeper_age_s)
    for job_id in job_ids:
        node.submitter.publish(node.store.get(job_id))
    return len(job_ids)


def _loop(stop: threading.Event, interval_s: float, name: str, step: Callable[[], object]) -> None:
    while not stop.wait(interval_s):
        try:
            step()
        except StorageError as exc:
            log.warning("%s: storage unavailable (%s); will retry", name, exc)
        except Exception:  # a background loop must outlive any one bad iteration
            log.exception("%s failed; will retry", name)


class Maintenance:
    """Starts and stops the node's background threads."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start heartbeat, reaper and sweeper threads (daemon; `stop` joins them)."""
        settings = self.node.settings
        loops: list[tuple[str, float, Callable[[], object]]] = [
            ("heartbeat", settings.heartbeat_interval_s, lambda: heartbeat(self.node)),
            ("reaper", settings.reaper_interval_s, lambda: reap_expired(self.node)),
            ("sweeper", settings.reaper_interval_s, lambda: sweep_unpublished(self.node)),
            ("pruner", PRUNE_INTERVAL_S, lambda: prune_indexes(self.node)),
            ("cancels", CANCEL_POLL_S, lambda: watch_cancels(self.node)),
        ]
        heartbeat(self.node)
        for name, interval, step in loops:
            thread = threading.Thread(
                target=_loop,
                args=(self._stop, interval, name, step),
                name=f"kiln-{name}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop the loops and wait for them."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
