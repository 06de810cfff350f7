"""The control room: the cluster's loops declared, and the queues they watch.

Each component is safe with many processes running it at once: the reaper's `reap` is won by
one caller per job, a dead node's lapse is claimed by one sweeper (storage/lua/held_claim.lua),
each queue's audit by one process per interval (storage/lua/audit_claim.lua) and each Redis
restart by one (storage/queues.py `server_changed`), pruning is idempotent, and a batch is fed
by the holder of its feeder lease alone (storage/leases.py). So they run inside every
node by default (`KILN_NODE_CONTROL_LOOPS`), and also alone as `kiln control`, beside nodes or
instead of their loops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from kiln.common.request import Lane
from kiln.tasks.batches.feeder import BatchFeeder
from kiln.tasks.control.audit import audit_after_restart, audit_queued, audit_tick_s
from kiln.tasks.control.components import Component, never_paused
from kiln.tasks.control.context import ControlContext
from kiln.tasks.control.paused import expire_paused
from kiln.tasks.control.preemption import preemption_step
from kiln.tasks.control.reaper import prune_indexes, reap_expired
from kiln.tasks.control.sweeper import sweep_unpublished
from kiln.tasks.queue.lanes import node_queues
from kiln.tasks.queue.served import served_now

# pruning is cheap and never urgent: index entries outlive their records by this much at most
PRUNE_INTERVAL_S = 60.0


def cluster_components(
    ctx: ControlContext,
    queues: Callable[[], Sequence[str]],
    feeding_paused: Callable[[], bool] = never_paused,
) -> list[Component]:
    """The cluster's loops over `ctx`; the audits watch `queues()`, the feeder rests while paused.

    A node passes its own queues and its drain (a draining node lets its batch leases lapse);
    `kiln control` passes every queue the cluster serves (`served_queues`).
    """
    settings = ctx.settings
    feeder = BatchFeeder(ctx.store, ctx.objects, ctx.submitter, settings, ctx.owner, ctx.celery_app)
    return [
        Component("reaper", settings.reaper_interval_s, functools.partial(reap_expired, ctx)),
        Component("sweeper", settings.reaper_interval_s, functools.partial(sweep_unpublished, ctx)),
        Component("pruner", PRUNE_INTERVAL_S, functools.partial(prune_indexes, ctx)),
        # paused jobs past KILN_PAUSED_RETENTION_S (days): as rarely as the pruner
        Component("paused", PRUNE_INTERVAL_S, functools.partial(expire_paused, ctx)),
        Component(
            "restarts", settings.reaper_interval_s, lambda: audit_after_restart(ctx, queues())
        ),
        Component("audit", audit_tick_s(settings), lambda: audit_queued(ctx, queues())),
        Component("batches", settings.batch_feed_interval_s, feeder.tick, feeding_paused),
        Component("preemption", settings.reaper_interval_s, preemption_step(ctx, queues)),
    ]


def served_queues(ctx: ControlContext) -> list[str]:
    """Every job queue of the cluster: each lane of each pipeline configured or announced."""
    served = served_now(ctx.store, ctx.settings.pipelines)
    return node_queues(list(Lane), served.names)
