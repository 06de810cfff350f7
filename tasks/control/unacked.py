"""The messages a dead node held: those it listed, and those it died before listing.

A node lists each `run_job` message as held the moment its strategy gets it (tasks/node/held.py),
but kombu's Redis transport has recorded the delivery as unacknowledged a moment earlier (its
`unacked` hash, indexed by time in `unacked_index`, before the consumer callback: the layout and
the order are tasks/queue/kombu_redis.py's, items 3 and 4).
A node killed in between leaves a delivery no list names, which kombu restores only after the
visibility timeout (`restore_visible`, an hour). The dead node died between its last held-list
write and its heartbeat deadline (storage/nodes.py `LapsedHolder`), so the sweeper reads kombu's
deliveries of that window once, as it claims the lapse, and publishes again the jobs among them
that are still queued, not listed by a live node and not leased. A delivery of a live node read
there (a running job, a countdown it listed) is left alone by those tests; one a live node took
a moment before the read and has not listed yet gets a duplicate message, which is harmless:
a queued job is held by one delivery only (storage/lua/hold.lua: its lease), started by that
delivery's token alone; the others are deferred (lease busy) or dropped (finished) by
tasks/node/jobs.py.

Not closed from here: kombu pops a message with BRPOP and records it in `unacked` with one
pipeline after the reply is read (tasks/queue/kombu_redis.py, item 4). A node
killed between the two, or a connection lost with the BRPOP reply in flight, loses the message:
it is in neither the queue nor `unacked`: the queued-jobs audit (tasks/control/audit.py) publishes
its job again; a claimed lapse makes that audit due at once, for every job queued before the dead
node's deadline (a connection lost without a death waits for `queued_audit_age_s`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kiln.common.states import JobState
from kiln.storage.nodes import LapsedHolder
from kiln.tasks.queue.kombu_redis import run_job_id, unacked_keys

if TYPE_CHECKING:
    from celery import Celery

    from kiln.storage.job_store import JobStore

log = logging.getLogger(__name__)

# kombu stamps a delivery with the consumer host's clock, the held list with Redis's: a lapse's
# window is widened by this much for clock skew (and the moment between kombu's record and the
# node's listing, which a heartbeat write from another thread may fall into).
CLOCK_SLACK_S = 5.0
# At most this many deliveries read from one window (a lapse's few seconds of the whole
# cluster's deliveries); past it the rest wait for the visibility timeout, with a warning.
WINDOW_LIMIT = 5000


def orphaned_jobs(store: JobStore, app: Celery) -> list[str]:
    """Claim the held lists of lapsed nodes; the job ids their messages carried.

    Those the dead nodes listed, and those of kombu's unacknowledged deliveries from the moments
    they died in that are queued, held by no live node and not leased. The caller publishes the
    still-queued ones again.
    """
    claim = store.claim_lapsed_holders()
    if not claim.holders:
        return []
    listed = {job_id for holder in claim.holders for job_id in holder.job_ids}
    index_key, hash_key = unacked_keys(app)
    delivered: set[str] = set()
    for since_s, until_s in lapse_windows(claim.holders):
        values = store.unacked_deliveries(index_key, hash_key, since_s, until_s, WINDOW_LIMIT)
        if len(values) >= WINDOW_LIMIT:
            log.warning("over %d unacked deliveries around a lapse: the rest wait", WINDOW_LIMIT)
        delivered.update(job_id for job_id in map(run_job_id, values) if job_id is not None)
    unlisted = unclaimed_queued(store, delivered - listed - claim.live_job_ids)
    for holder in claim.holders:
        log.info("node %s lapsed holding %d listed message(s)", holder.node_id, len(holder.job_ids))
    if unlisted:
        log.info("%d queued job(s) whose delivery a dead node never listed", len(unlisted))
    return sorted(listed | unlisted)


def lapse_windows(holders: list[LapsedHolder]) -> list[tuple[float, float]]:
    """The times (s) the lapsed nodes may have died in, widened by the slack, overlaps merged."""
    spans = sorted(
        (h.written_ms / 1000 - CLOCK_SLACK_S, h.deadline_ms / 1000 + CLOCK_SLACK_S)
        for h in holders
        if h.written_ms > 0  # an unreadable entry has no window
    )
    merged: list[tuple[float, float]] = []
    for since_s, until_s in spans:
        if merged and since_s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], until_s))
        else:
            merged.append((since_s, until_s))
    return merged


def unclaimed_queued(store: JobStore, job_ids: set[str]) -> set[str]:
    """Those of `job_ids` that are queued without a lease (one read for all, then the few)."""
    records = store.get_many(sorted(job_ids))
    queued = [r.id for r in records if r is not None and r.state == JobState.QUEUED]
    return set(queued) - store.leased(queued)
