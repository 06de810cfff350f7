"""Paused jobs past their retention expire (docs/contract.md §4a, operations §4b).

A paused job holds no GPU but keeps its record and its step checkpoints in the object store; one
left paused `KILN_PAUSED_RETENTION_S` (7 days by default) ends `expired` (reason
`paused_retention`), its checkpoints deleted. Each expiry is one fenced transition that only
one caller wins, so every control process may run this.
"""

from __future__ import annotations

import logging

from kiln.storage.checkpoints import Checkpoints
from kiln.storage.errors import IllegalTransition
from kiln.tasks.control.context import ControlContext
from kiln.tasks.webhooks.event_sink import EventSink

log = logging.getLogger(__name__)


def expire_paused(ctx: ControlContext) -> int:
    """Expire the jobs paused longer than the retention; returns how many this call expired."""
    store = ctx.store
    due = store.paused_past(ctx.storage_settings.paused_retention_s)
    if not due:
        return 0
    sink, checkpoints = EventSink(store, ctx.celery_app), Checkpoints(store, ctx.objects)
    expired = 0
    for job_id in due:
        try:
            record = store.expire_paused(job_id)
        except IllegalTransition:  # resumed or canceled meanwhile, or expired by another
            continue
        checkpoints.discard(job_id)  # no attempt will read them now
        sink.changed(record)
        expired += 1
        log.info("job %s expired: paused longer than KILN_PAUSED_RETENTION_S", job_id)
    return expired
