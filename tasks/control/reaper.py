"""The reaper: running jobs whose lease lapsed go back to their queue (storage/leases.py)."""

from __future__ import annotations

import logging

from kiln.tasks.control.context import ControlContext

log = logging.getLogger(__name__)


def reap_expired(ctx: ControlContext) -> int:
    """Re-queue and re-publish jobs whose lease expired while running; returns how many.

    `reap` is one script that only one caller wins per job, so every process may run this.
    """
    reaped = 0
    for job_id in ctx.store.expired_leases():
        if ctx.store.reap(job_id):
            ctx.submitter.publish(ctx.store.get(job_id))
            reaped += 1
            log.info("reaped job %s (its lease expired while running)", job_id)
    return reaped


def prune_indexes(ctx: ControlContext) -> int:
    """Drop index entries of finished jobs whose records have expired (retention), all due."""
    return ctx.store.prune_due_indexes()
