"""The audit of queued jobs whose message is lost: in no queue, not unacknowledged, held by no node.

kombu's Redis transport pops a message with BRPOP and records it in its `unacked` hash one
pipeline later (tasks/queue/kombu_redis.py, item 4). A node killed between the two, or a
connection lost with the BRPOP reply in flight, loses the message, and its job stays `queued`
with `published` set: the sweeper (unconfirmed publishes) and the held-list recovery (a dead
node's deliveries) never see it. So one node serving a queue (storage/lua/audit_claim.lua)
audits it every `queued_audit_interval_s`, and again as soon as a sweeper has claimed a node's
lapse (storage/lua/held_claim.lua records it): a node killed with a BRPOP reply unread loses
that message, so after a lapse a job that entered its queue before the dead node's heartbeat
deadline is a suspect at once, and the loss costs seconds rather than the audit age. A pass
reads on only when the queue's oldest job entered it over `queued_audit_age_s` ago, or before
the latest lapse (one index entry and one event read: the usual pass stops there); it then
reads, in this order, which is the order a message moves in:

1. the job ids of the messages in the queue's lists (every priority list, pages of 1000);
2. the old queued jobs of the queue's index that are not among them (the suspects);
3. the jobs nodes listed as held, then, if suspects remain, kombu's whole `unacked` hash (pages;
   not after a Redis restart, when a delivery there may be stranded: `audit_after_restart`);
4. again for the suspects left: the held lists, kombu's deliveries recorded since the pass began
   (a message in the BRPOP window during step 1 is recorded there a moment later), and each
   record: still queued, published, no lease.

A message moving on between two reads is seen by the later one; only one moving back (kombu
restoring an unacked message to its list after the visibility timeout) or still in the BRPOP
window at step 4 is missed, and then the job gets a second message. That is harmless: a queued
job is held by one delivery only (storage/lua/hold.lua: its lease) and started by that
delivery's token alone; the others are deferred or dropped (tasks/node/jobs.py). Cost per pass
of an audited queue with an old job: O(messages in its lists + queued jobs older than the age),
plus O(entries of `unacked`) once when suspects remain; nothing for a queue whose head is young.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kiln.common.states import JobState
from kiln.storage.audit import AUDIT_PAGE, AuditOps
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.control.context import ControlContext
from kiln.tasks.control.sweeper import publish_queued
from kiln.tasks.control.unacked import CLOCK_SLACK_S, WINDOW_LIMIT
from kiln.tasks.queue.kombu_redis import (
    listed_run_job_id,
    queue_list_keys,
    run_job_id,
    unacked_keys,
)

if TYPE_CHECKING:
    from celery import Celery

    from kiln.storage.job_store import JobStore

log = logging.getLogger(__name__)

# the re-read of kombu's deliveries since a pass began reaches this far past its start (s)
RECHECK_HORIZON_S = 3600.0


def _list_entries(store: AuditOps, key: str) -> Iterator[str]:
    start = 0
    while page := store.list_page(key, start):
        yield from page
        if len(page) < AUDIT_PAGE:
            return
        start += len(page)  # a push at the head meanwhile makes a page overlap, never skip


def listed_job_ids(store: AuditOps, app: Celery, queue: str) -> set[str]:
    """The job ids of the messages waiting in `queue`'s lists."""
    ids: set[str] = set()
    for key in queue_list_keys(app, queue):
        ids.update(filter(None, map(listed_run_job_id, _list_entries(store, key))))
    return ids


def unacked_job_ids(store: AuditOps, app: Celery) -> set[str]:
    """The job ids of every delivery kombu holds unacknowledged (its hash, scanned in pages)."""
    _, hash_key = unacked_keys(app)
    ids: set[str] = set()
    cursor = 0
    while True:
        cursor, values = store.hash_page(hash_key, cursor)
        ids.update(filter(None, map(run_job_id, values)))
        if cursor == 0:
            return ids


def old_unlisted(store: AuditOps, queue: str, before_s: float, listed: set[str]) -> set[str]:
    """The jobs of `queue`'s index that entered it before `before_s` and are not in `listed`.

    The index is in the order jobs entered the queue: the walk stops at the first younger one.
    """
    old: set[str] = set()
    after: float | None = None
    while page := store.queued_page(queue, after):
        since = store.queued_since([job_id for job_id, _ in page])
        for job_id, score in page:
            after = score
            entered = since.get(job_id)  # None: no record left (a pruned entry), not a suspect
            if entered is not None and entered >= before_s:
                return old
            if entered is not None and job_id not in listed:
                old.add(job_id)
        if len(page) < AUDIT_PAGE:
            break
    return old


def head_is_old(store: AuditOps, queue: str, before_s: float) -> bool:
    """Whether `queue`'s oldest queued job entered it before `before_s` (the cheap check)."""
    head = store.queued_page(queue, None)[:1]
    since = store.queued_since([job_id for job_id, _ in head])
    return any(since.get(job_id, before_s) < before_s for job_id, _ in head)


def still_lost(
    store: JobStore, app: Celery, suspects: set[str], since_s: float, began_s: float
) -> list[str]:
    """Of `suspects`, those still lost: read again just before they are published.

    Held by no node, not delivered since `since_s` (by the consumers' clocks), and queued,
    published and not leased.
    """
    suspects = suspects - store.held_jobs()
    if not suspects:
        return []
    index_key, hash_key = unacked_keys(app)
    recent = store.unacked_deliveries(
        index_key, hash_key, since_s, began_s + RECHECK_HORIZON_S, WINDOW_LIMIT
    )
    suspects -= set(filter(None, map(run_job_id, recent)))
    records = store.get_many(sorted(suspects))
    queued = [r.id for r in records if r and r.state == JobState.QUEUED and r.published]
    return sorted(set(queued) - store.leased(queued))


def lost_jobs(
    store: JobStore,
    app: Celery,
    queues: Sequence[str],
    age_s: float,
    lapse_deadline_s: float = 0.0,
    *,
    unacked_is_held: bool = True,
) -> list[str]:
    """The queued jobs of `queues` whose message is nowhere.

    Suspects are those in their queue for over `age_s`, or since before `lapse_deadline_s` (the
    latest node death, widened by the clock slack): a dead node can have lost only those.
    Without `unacked_is_held` (after a Redis restart) a delivery recorded in kombu's `unacked`
    before the pass began proves nothing: its consumer's connection broke, and the channel's
    restore of it may have failed as Redis went down.
    """
    began_s = store.redis_now()
    before_s = max(began_s - age_s, min(began_s, lapse_deadline_s + CLOCK_SLACK_S))
    suspects: set[str] = set()
    for queue in queues:
        if head_is_old(store, queue, before_s):
            suspects |= old_unlisted(store, queue, before_s, listed_job_ids(store, app, queue))
    if suspects:
        suspects -= store.held_jobs()
    if suspects and unacked_is_held:
        suspects -= unacked_job_ids(store, app)
    if not suspects:
        return []
    # the deliveries since the pass began, widened by the clock slack; after a restart not
    # widened back into the moments before it, whose deliveries may be stranded
    since_s = began_s - CLOCK_SLACK_S if unacked_is_held else began_s
    return still_lost(store, app, suspects, since_s, began_s)


def audit_queued(ctx: ControlContext, queues: Sequence[str]) -> int:
    """Publish again the queued jobs of `queues` whose message is lost; returns how many.

    Audits those of `queues` no process audited within the interval, or since the latest node
    lapse (storage/lua/audit_claim.lua). The loop runs every `audit_tick_s`, the claim says which
    are due; its interval is a little shorter than the setting, so a lone process's pass is never
    skipped for a few ms of clock difference.
    """
    if not queues:  # a node serving no pipeline (tests): nothing to claim
        return 0
    settings = ctx.settings
    claim = ctx.store.claim_audits(list(queues), 0.9 * settings.queued_audit_interval_s)
    lost = lost_jobs(
        ctx.store, ctx.celery_app, claim.queues, settings.queued_audit_age_s, claim.lapse_deadline_s
    )
    return publish_lost(ctx, lost)


def audit_after_restart(ctx: ControlContext, queues: Sequence[str]) -> int:
    """After a Redis restart, audit `queues` at once; returns how many jobs were published again.

    The messages consumers were taking as Redis went down are lost (popped, never recorded as
    unacknowledged: tasks/queue/kombu_redis.py, item 4) while their jobs stay `queued`: the
    queued-jobs audit's loss. So are those recorded but not yet handed to Celery when the
    connection broke (a BRPOP reply read as the channel closes), whose restore failed as Redis
    went down: they stay in `unacked` until the visibility timeout, so here `unacked` does not
    count as held; a job held by a live node is in its held list or leased. As after a node
    lapse, every job queued before now is a suspect at once, not only those older than the audit
    age; of several processes watching a queue, one sees each restart (storage/queues.py
    `server_changed`).
    """
    if not queues:
        return 0
    run_id = ctx.store.server_run_id()
    restarted = [queue for queue in queues if ctx.store.server_changed(queue, run_id)]
    if not restarted:
        return 0
    log.warning("Redis restarted: auditing %s at once", ", ".join(restarted))
    lost = lost_jobs(
        ctx.store,
        ctx.celery_app,
        restarted,
        ctx.settings.queued_audit_age_s,
        ctx.store.redis_now(),
        unacked_is_held=False,
    )
    return publish_lost(ctx, lost)


def publish_lost(ctx: ControlContext, lost: list[str]) -> int:
    """Publish again the audit's `lost` jobs still queued; returns how many."""
    for job_id in lost:
        log.warning(
            "job %s: queued, its message in no queue, unacked or held list and no lease (lost "
            "in a consumer's fetch): published again",
            job_id,
        )
    return publish_queued(ctx, lost)


def audit_tick_s(settings: KilnSettings) -> float:
    """How often the audit loop asks which queues are due (one small script call).

    Each heartbeat interval: a message lost at a node's death is then published again within
    the heartbeat TTL, a sweeper pass and one tick (6 + 5 + 2 s by default), under a lease TTL.
    """
    return min(settings.heartbeat_interval_s, settings.queued_audit_interval_s)
