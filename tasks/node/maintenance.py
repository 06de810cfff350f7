"""A node's own loops, declared as components (tasks/control/components.py; docs/operations.md §5).

The node's components (`node_components`; some only for a `kiln worker` node):

- heartbeat (every `heartbeat_interval_s`): renew held leases, then publish the node's health;
- cancel watch (every `CANCEL_POLL_S`): tell the jobs it holds that were asked to stop (a
  cancel, a pause, a priority preemption: one stop request per job, storage/leases.py) to stop,
  reading all of their requests in one command;
- held list (every `HELD_LIST_INTERVAL_S`): list in Redis the job messages that reached the
  worker since the last write (tasks/node/held.py), so the Celery consumer never waits for it;
- owed (every `OWED_RETRY_S`): publish again the jobs owed a message, a re-publish that failed or
  a delivery let go while Redis was away (tasks/queue/submit.py `Submitter.publish_owed`);
- controls (every `CONTROL_POLL_S`, for a `kiln worker` node): apply queue pauses and the node's
  drain request (tasks/node/controls.py);
- surplus (every `heartbeat_interval_s`, for a `kiln worker` node with `KILN_SURPLUS_EXIT`): an
  idle node its pipelines no longer need drains and exits (tasks/node/surplus.py).

With `KILN_NODE_CONTROL_LOOPS` (the default) the node also runs the cluster's loops over its own
queues (tasks/control/room.py: reaper, sweeper, pruner, restart audit, queued-jobs audit, batch
feeder; the feeder rests while the node drains); without it `kiln control` runs them.

On their own threads, a long compute step never starves lease renewal. The heartbeat's start
(`announce`) sends one at once, so the node is announced before its first interval passes.
"""

from __future__ import annotations

import logging

from kiln.common.stops import StopReason
from kiln.storage.errors import StorageError
from kiln.storage.leases import Renewal
from kiln.tasks.control.components import Component, Loops
from kiln.tasks.control.context import ControlContext
from kiln.tasks.control.room import cluster_components
from kiln.tasks.node.controls import CONTROL_POLL_S, NodeControls
from kiln.tasks.node.held import HELD_LIST_INTERVAL_S
from kiln.tasks.node.node import Node, TrackedJob
from kiln.tasks.node.surplus import SurplusWatch

log = logging.getLogger(__name__)

# how often owed messages are tried again (a Redis restart or failover: seconds)
OWED_RETRY_S = 0.5

# A heartbeat outlives a few missed intervals, never less than this (docs/operations.md §1).
HEARTBEAT_TTL_MIN_S = 5.0
# A cancel must land within a denoising step; one read (MGET) per poll is cheap.
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
            tracked.stop_reason = StopReason.LEASE_LOST
        elif renewal is Renewal.ENDED and tracked.stop_reason is None:
            # Usually this node's own last transition, a moment before the job leaves the
            # tracked set: no failure. Otherwise the job ended elsewhere: stop computing it.
            tracked.stop_reason = StopReason.LEASE_LOST


def heartbeat_ttl(node: Node) -> float:
    """How long a heartbeat (and the list of held messages) stays valid."""
    return max(3.0 * node.settings.heartbeat_interval_s, HEARTBEAT_TTL_MIN_S)


def heartbeat(node: Node) -> None:
    """One heartbeat: leases first (they matter most), then the node's health record."""
    renew_leases(node)
    node.store.publish_node(node.node_id, node.health(), heartbeat_ttl(node))
    node.held.write()
    node.report_usage()  # its idle GPU-seconds (tasks/node/usage.py)


def announce(node: Node) -> None:
    """The heartbeat's start: held messages are listed from now on, and one heartbeat goes now.

    So the node is announced before its first interval passes.
    """
    node.held.publish_with(
        lambda job_ids: node.store.record_held(
            node.node_id,
            # its owed jobs too: if it dies owing them, a sweeper publishes them again
            sorted({*job_ids, *node.submitter.owed()}),
            heartbeat_ttl(node),
            node.held.incarnation,
        )
    )
    heartbeat(node)


def watch_cancels(node: Node) -> None:
    """The cancel watch's step: tell the jobs asked to stop to stop, one read for all of them.

    A cancel, a pause and a priority preemption take one path: the job's stop request, read
    here, ends its run at its next step; a pause's and a preemption's stop take a step
    checkpoint there (gpu_worker/inflight.py CHECKPOINTED_STOPS).
    """
    held = {t.job_id: t for t in node.tracked_jobs() if t.stop_reason is None}
    for job_id, request in node.store.stops_requested(list(held)).items():
        tracked = held[job_id]
        if request.reason == StopReason.PREEMPTED:
            if not preemptible(tracked):
                continue  # left to lapse: its run has no step to keep, or has not started
            tracked.preempted_for = request.for_job
            log.info(
                "job %s: preempted for job %s, stops at its next step", job_id, request.for_job
            )
        tracked.stop_reason = request.reason


def preemptible(tracked: TrackedJob) -> bool:
    """Whether a preemption stops this job: its group runs it and a stop checkpoints its step.

    A run that takes no checkpoints would throw its steps away (its node never lists it as
    one a preemption may suspend: tasks/control/preemption.py).
    """
    return tracked.started and tracked.checkpoints


def node_context(node: Node) -> ControlContext:
    """The node's own settings, stores and Celery app, for the cluster's loops it runs."""
    return ControlContext(
        settings=node.settings,
        storage_settings=node.storage_settings,
        store=node.store,
        objects=node.objects,
        celery_app=node.celery_app,
        submitter=node.submitter,
        owner=node.node_id,
    )


def node_components(node: Node, controls: NodeControls | None) -> list[Component]:
    """The loops of this node alone: heartbeat and cancels; controls and surplus with `controls`."""
    settings = node.settings
    components = [
        Component(
            "heartbeat",
            settings.heartbeat_interval_s,
            lambda: heartbeat(node),
            start=lambda: announce(node),
        ),
        Component("cancels", CANCEL_POLL_S, lambda: watch_cancels(node)),
        Component("held", HELD_LIST_INTERVAL_S, node.held.write_if_changed),
        Component("owed", OWED_RETRY_S, node.submitter.publish_owed),
    ]
    if controls is not None:
        components.append(Component("controls", CONTROL_POLL_S, controls.poll))
        if settings.surplus_exit:  # tasks/node/surplus.py
            surplus = SurplusWatch(node, sorted(node.group_config.pipelines))
            components.append(Component("surplus", settings.heartbeat_interval_s, surplus.tick))
    return components


class Maintenance:
    """Starts and stops the node's loops, and the cluster's with `KILN_NODE_CONTROL_LOOPS`."""

    def __init__(self, node: Node, controls: NodeControls | None = None) -> None:
        self.node = node
        self.controls = controls  # operator controls: the node's queues, pauses and drain
        components = node_components(node, controls)
        if node.settings.node_control_loops:
            queues = list(controls.queues) if controls is not None else []
            components += cluster_components(
                node_context(node), lambda: queues, node.draining.is_set
            )
        self.loops = Loops(components)

    def start(self) -> None:
        """Start the loops (daemon threads; `stop` joins them): the heartbeat's start announces."""
        node = self.node
        self.loops.start()
        left = "" if node.settings.node_control_loops else " (the cluster's: kiln control's)"
        log.info("node %s loops: %s%s", node.node_id, ", ".join(self.loops.names), left)

    def stop(self) -> None:
        """Stop the loops and wait for them."""
        self.loops.stop()
