"""The reaper: running jobs whose lease lapsed go back to their queue (storage/leases.py)."""

from __future__ import annotations

import logging

from kiln.tasks.control.context import ControlContext

log = logging.getLogger(__name__)


def reap_expired(ctx: ControlContext) -> int:
    """Re-queue and re-publish jobs whose lease expired while running; returns how many.

    The move is one script per pass (storage/leases.py `reap_lapsed`) that applies once per job
    whoever runs it, so every process may run this.
    """
    reaped = ctx.store.reap_lapsed()
    for job_id in reaped:
        ctx.submitter.publish(ctx.store.get(job_id))
        log.info("reaped job %s (its lease expired while running)", job_id)
    return len(reaped)


def prune_indexes(ctx: ControlContext) -> int:
    """Drop index entries of finished jobs whose records have expired (retention), all due."""
    return ctx.store.prune_due_indexes()
