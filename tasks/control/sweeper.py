"""The sweeper: queued jobs whose message is missing are published again."""

from __future__ import annotations

import logging

from kiln.common.states import JobState
from kiln.tasks.control.context import ControlContext
from kiln.tasks.control.unacked import orphaned_jobs

log = logging.getLogger(__name__)


def sweep_unpublished(ctx: ControlContext) -> int:
    """Publish queued records whose message is missing; returns how many.

    Those whose publish was never confirmed, and those whose message a dead node held, listed
    or not (tasks/node/held.py, tasks/control/unacked.py): still queued, they would wait for the
    broker's visibility timeout. A dead node's lapse is claimed by one sweeper only.
    """
    ctx.submitter.publish_owed()  # this process's own failed re-publishes (a `kiln control`'s)
    unconfirmed = publish_queued(ctx, ctx.store.unpublished_jobs(ctx.settings.sweeper_age_s))
    orphaned = publish_queued(ctx, orphaned_jobs(ctx.store, ctx.celery_app))
    if orphaned:
        log.info("%d job(s) whose message a dead node held: published again", orphaned)
    return unconfirmed + orphaned


def publish_queued(ctx: ControlContext, job_ids: list[str]) -> int:
    """Publish again those of `job_ids` still queued (one read for all); returns how many."""
    queued = [r for r in ctx.store.get_many(job_ids) if r and r.state == JobState.QUEUED]
    for record in queued:
        ctx.submitter.publish(record)
    return len(queued)
