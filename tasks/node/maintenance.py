"""A node's background loops, one thread each (docs/operations.md §5).

The loops it starts (`Maintenance.start`; some only for a `kiln worker` node):

- heartbeat (every `heartbeat_interval_s`): renew held leases, then publish the node's health;
- reaper (every `reaper_interval_s`): re-queue and re-publish running jobs whose lease expired;
- sweeper (every `reaper_interval_s`): re-publish queued jobs whose publish was never confirmed,
  and those whose message a node held when it died (tasks/node/held.py);
- pruner (every `PRUNE_INTERVAL_S`): drop index entries of expired records;
- cancel watch (every `CANCEL_POLL_S`): tell running jobs with a pending cancel to stop;
- controls (every `CONTROL_POLL_S`, for a `kiln worker` node): apply queue pauses and the node's
  drain request (tasks/node/controls.py);
- restarts (every `reaper_interval_s`, for a `kiln worker` node): after a Redis restart, audit
  the node's queues at once (messages being taken at the time are lost: `audit_after_restart`);
- surplus (every `heartbeat_interval_s`, for a `kiln worker` node with `KILN_SURPLUS_EXIT`): an
  idle node its pipelines no longer need drains and exits (tasks/node/surplus.py);
- audit (for a `kiln worker` node; due every `queued_audit_interval_s` and after each node lapse,
  asked every `heartbeat_interval_s`): publish again the queued jobs whose message is nowhere
  (tasks/node/audit.py), one node per queue and interval or lapse;
- batches (every `batch_feed_interval_s`, not while draining): feed the active batches whose
  feeder lease this node holds or can take, and write their results (tasks/batches/feeder.py).

On their own threads, a long compute step never starves lease renewal. One heartbeat also runs
in `Maintenance.start`, so the node is announced before its first interval passes.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

from kiln.common.states import JobState
from kiln.storage.errors import StorageError
from kiln.storage.leases import Renewal
from kiln.tasks.batches.feeder import BatchFeeder
from kiln.tasks.node.audit import lost_jobs
from kiln.tasks.node.controls import CONTROL_POLL_S, NodeControls
from kiln.tasks.node.node import JobStopReason, Node
from kiln.tasks.node.surplus import SurplusWatch
from kiln.tasks.node.unacked import orphaned_jobs

log = logging.getLogger(__name__)

PRUNE_INTERVAL_S = 60.0
# A heartbeat outlives a few missed intervals, never less than this (docs/operations.md §1).
HEARTBEAT_TTL_MIN_S = 5.0
# A cancel must land within a denoising step; one pipelined read per poll is cheap.
CANCEL_POLL_S = 0.02


def renew_leases(node: Node) -> None:
    """Renew every held lease; a job whose lease is gone is told to stop."""
    for tracked in node.tracked_jobs():
        try:
            renewal = node.store.renew_lease(tracked.job_id, tracked.lease_token)
        except StorageError:
            node.metrics.count_lease_renewal_failure()
            raise
        if renewal is Renewal.LOST:
            node.metrics.count_lease_renewal_failure()
            log.warning("lease of job %s was lost; stopping it", tracked.job_id)
            tracked.stop_reason = JobStopReason.LEASE_LOST
        elif renewal is Renewal.ENDED and tracked.stop_reason is None:
            # Usually this node's own last transition, a moment before the job leaves the
            # tracked set: no failure. Otherwise the job ended elsewhere: stop computing it.
            tracked.stop_reason = JobStopReason.LEASE_LOST


def heartbeat_ttl(node: Node) -> float:
    """How long a heartbeat (and the list of held messages) stays valid."""
    return max(3.0 * node.settings.heartbeat_interval_s, HEARTBEAT_TTL_MIN_S)


def heartbeat(node: Node) -> None:
    """One heartbeat: leases first (they matter most), then the node's health record."""
    renew_leases(node)
    node.store.publish_node(node.node_id, node.health(), heartbeat_ttl(node))
    node.held.write()


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
        running[job_id].stop_reason = JobStopReason.CANCELED


def prune_indexes(node: Node) -> int:
    """Drop index entries of finished jobs whose records have expired (retention), all due."""
    return node.store.prune_due_indexes()


def sweep_unpublished(node: Node) -> int:
    """Publish queued records whose message is missing; returns how many.

    Those whose publish was never confirmed, and those whose message a dead node held, listed
    or not (tasks/node/held.py, tasks/node/unacked.py): still queued, they would wait for the
    broker's visibility timeout.
    """
    unconfirmed = publish_queued(node, node.store.unpublished_jobs(node.settings.sweeper_age_s))
    orphaned = publish_queued(node, orphaned_jobs(node.store, node.celery_app))
    if orphaned:
        log.info("%d job(s) whose message a dead node held: published again", orphaned)
    return unconfirmed + orphaned


def publish_queued(node: Node, job_ids: list[str]) -> int:
    """Publish again those of `job_ids` still queued (one read for all); returns how many."""
    queued = [r for r in node.store.get_many(job_ids) if r and r.state == JobState.QUEUED]
    for record in queued:
        node.submitter.publish(record)
    return len(queued)


def audit_after_restart(node: Node, queues: list[str]) -> int:
    """After a Redis restart, audit `queues` at once; returns how many jobs were published again.

    The messages consumers were taking as Redis went down are lost (popped, never recorded as
    unacknowledged: tasks/queue/kombu_redis.py, item 4) while their jobs stay `queued`: the
    queued-jobs audit's loss. As after a node lapse, every job queued before now is a suspect at
    once, not only those older than the audit age; of several nodes serving a queue, one sees
    each restart (storage/queues.py `server_changed`).
    """
    run_id = node.store.server_run_id()
    restarted = [queue for queue in queues if node.store.server_changed(queue, run_id)]
    if not restarted:
        return 0
    log.warning("Redis restarted: auditing %s at once", ", ".join(restarted))
    settings = node.settings
    lost = lost_jobs(
        node.store, node.celery_app, restarted, settings.queued_audit_age_s, node.store.redis_now()
    )
    return publish_lost(node, lost)


def audit_queued(node: Node, queues: list[str]) -> int:
    """Publish again the queued jobs of `queues` whose message is lost; returns how many.

    Audits those of `queues` no node audited within the interval, or since the latest node
    lapse (tasks/node/audit.py). The loop runs every `audit_tick_s`, the claim says which are
    due; its interval is a little shorter than the setting, so a lone node's pass is never
    skipped for a few ms of clock difference.
    """
    settings = node.settings
    claim = node.store.claim_audits(queues, 0.9 * settings.queued_audit_interval_s)
    lost = lost_jobs(
        node.store,
        node.celery_app,
        claim.queues,
        settings.queued_audit_age_s,
        claim.lapse_deadline_s,
    )
    return publish_lost(node, lost)


def publish_lost(node: Node, lost: list[str]) -> int:
    """Publish again the audit's `lost` jobs still queued; returns how many."""
    for job_id in lost:
        log.warning(
            "job %s: queued, its message in no queue, unacked or held list and no lease (lost "
            "in a consumer's fetch): published again",
            job_id,
        )
    return publish_queued(node, lost)


def audit_tick_s(node: Node) -> float:
    """How often the audit loop asks which queues are due (one small script call).

    Each heartbeat interval: a message lost at a node's death is then published again within
    the heartbeat TTL, a sweeper pass and one tick (6 + 5 + 2 s by default), under a lease TTL.
    """
    settings = node.settings
    return min(settings.heartbeat_interval_s, settings.queued_audit_interval_s)


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

    def __init__(self, node: Node, controls: NodeControls | None = None) -> None:
        self.node = node
        self.controls = controls  # operator controls: a sixth loop when given
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Send one heartbeat now, then start the loops (daemon threads; `stop` joins them)."""
        settings = self.node.settings
        node = self.node
        node.held.publish_with(
            lambda job_ids: node.store.record_held(
                node.node_id, job_ids, heartbeat_ttl(node), node.held.incarnation
            )
        )
        loops: list[tuple[str, float, Callable[[], object]]] = [
            ("heartbeat", settings.heartbeat_interval_s, lambda: heartbeat(self.node)),
            ("reaper", settings.reaper_interval_s, lambda: reap_expired(self.node)),
            ("sweeper", settings.reaper_interval_s, lambda: sweep_unpublished(self.node)),
            ("pruner", PRUNE_INTERVAL_S, lambda: prune_indexes(self.node)),
            ("cancels", CANCEL_POLL_S, lambda: watch_cancels(self.node)),
        ]
        if self.controls is not None:
            loops.append(("controls", CONTROL_POLL_S, self.controls.poll))
            restarts = functools.partial(audit_after_restart, self.node, self.controls.queues)
            loops.append(("restarts", settings.reaper_interval_s, restarts))
            audit = functools.partial(audit_queued, self.node, self.controls.queues)
            loops.append(("audit", audit_tick_s(self.node), audit))
            if settings.surplus_exit:  # tasks/node/surplus.py
                surplus = SurplusWatch(self.node, sorted(self.node.group_config.pipelines))
                loops.append(("surplus", settings.heartbeat_interval_s, surplus.tick))
        feeder = BatchFeeder(
            node.store, node.objects, node.submitter, settings, node.node_id, node.celery_app
        )

        def feed_batches() -> None:
            if not node.draining.is_set():  # a draining node lets its batch leases lapse
                feeder.tick()

        loops.append(("batches", settings.batch_feed_interval_s, feed_batches))
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
