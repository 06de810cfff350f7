"""Every lease: a fencing token that grows on every acquire, a TTL, renewal, what a lapse means.

Two kinds, one shape (`<token>|<owner>` under a TTL of `lease_ttl_s`, storage/keys.py):

- a job's lease (`LeaseOps`): taken by the delivery that holds the job on a node
  (storage/lua/hold.lua; acquire.lua takes it too), renewed by the node's
  heartbeat (renew.lua; tasks/node/maintenance.py `renew_leases`: a lost lease stops the job),
  released at the end (release.lua). Once it lapses, the reaper (tasks/control/reaper.py) finds
  the job and moves it back to queued in one script (reap_lapsed.lua, `reap_lapsed`; reap.lua,
  `reap`, moves one job); every later write of the old attempt is fenced off by its token;
- a batch's feeder lease (`FeederLeaseOps`): taken and renewed by each feeder pass
  (batch_lease.lua); once it lapses, the next feeder pass anywhere takes the batch over, and the
  old feeder's fenced writes (batch_fed.lua, batch_reported.lua) are refused.

Beside a job's lease, its stop request (`StopRequest`): what its holder is asked to stop the run
for, read by the node's cancel watch for all its jobs at once (`stops_requested`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from kiln.common.job_events import ProgressData
from kiln.common.stops import StopReason
from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary
from kiln.storage.keys import LEASE_SUFFIX, STOP_SUFFIX, WEBHOOKS_SUFFIX
from kiln.storage.settings import StorageSettings

# A running job's stop request (`keys.cancel`: one key, one value naming why) as storage/lua/
# _machine.lua writes and reads it: STOP_CANCEL ('1', as it always was), STOP_PAUSE, or a priority
# preemption, `preempt:<the waiting job's id>` (storage/lua/preempt_request.lua; an id holds no
# colon). Any other value is a cancel, as it always was.
_STOP_PAUSE = "pause"
_STOP_PREEMPT = "preempt:"
# what a stop request may ask, as this release reads it; a node's heartbeat lists them
# (`stops_read`, tasks/node/maintenance.py): one of an earlier release read every value but a
# pause as a cancel, so no preemption is asked of its jobs (tasks/control/preemption.py)
STOPS_READ = (StopReason.CANCELED, StopReason.PAUSED, StopReason.PREEMPTED)

# the reaper looks at this many overdue jobs per call; it runs every few seconds
_REAPER_BATCH = 1000


def lease_ttl_ms(settings: StorageSettings) -> int:
    """The lease TTL as the scripts take it: whole milliseconds, at least one."""
    return max(1, int(settings.lease_ttl_s * 1000))


# the progress stage of a queued job a node holds the lease of, until its group starts it
# (storage/lua/hold.lua): {"stage": WAITING_IN_NODE, "node": <node id>, "position": <jobs the
# node starts before it>}
WAITING_IN_NODE = "waiting_in_node"


def waiting_progress(node_id: str, position: int) -> ProgressData:
    """The progress of a job waiting in node `node_id` with `position` jobs ahead of it there."""
    return ProgressData(stage=WAITING_IN_NODE, node=node_id, position=position)


def delivery_owner(node_id: str, delivery: str) -> str:
    """A lease owner: one per delivery on a node; its node id is what precedes the last '/'."""
    return f"{node_id}/{delivery}"


@dataclass(frozen=True)
class StopRequest:
    """A running job's pending stop request: why its node stops it, and for whom if preempted.

    One per job, whoever asks (docs/operations.md §20): a cancel replaces a pause or a
    preemption, a pause replaces a preemption, and a preemption is asked only of a job with none.
    """

    reason: StopReason  # CANCELED, PAUSED or PREEMPTED
    for_job: str | None = None  # a preemption's waiting job, which the stop makes room for


def preemption_stop(for_job: str) -> str:
    """The stop request's value that asks for a preemption for the waiting job `for_job`."""
    return _STOP_PREEMPT + for_job


def read_stop(value: str) -> StopRequest:
    """What a stop request's stored value asks for."""
    if value == _STOP_PAUSE:
        return StopRequest(StopReason.PAUSED)
    if value.startswith(_STOP_PREEMPT):
        return StopRequest(StopReason.PREEMPTED, value.removeprefix(_STOP_PREEMPT))
    return StopRequest(StopReason.CANCELED)


class Renewal(Enum):
    """What a lease renewal found."""

    RENEWED = "renewed"
    ENDED = "ended"  # the job reached a terminal state: nothing left to hold, nothing lost
    LOST = "lost"  # another token is current (reaped, taken over) or the job is gone


_RENEWALS = {1: Renewal.RENEWED, 2: Renewal.ENDED}


class LeaseOps(StoreBase):
    """Acquire, renew and release job leases; find running jobs whose lease expired."""

    def _lease_keys(self, job_id: str) -> list[str]:
        """The KEYS of acquire.lua, renew.lua and release.lua."""
        return [self.keys.job(job_id), self.keys.lease(job_id), self.keys.running]

    @property
    def _lease_ttl_ms(self) -> int:
        return lease_ttl_ms(self.settings)

    @redis_boundary
    def acquire_lease(self, job_id: str, owner: str) -> int:
        """Take the job's lease for `owner`; returns a token larger than any issued before.

        Raises LeaseHeld if another owner holds a live lease. The same owner acquiring again gets
        a new token, which fences off its previous one.
        """
        self._require_id(job_id)
        keys = self._lease_keys(job_id)
        return int(self._run("acquire", keys, [job_id, owner, self._lease_ttl_ms]))

    @redis_boundary
    def renew_lease(self, job_id: str, lease_token: int) -> Renewal:
        """Extend the lease by its TTL while the token is the job's current one.

        ENDED when the job finished meanwhile (its holder's own last transition drops the lease
        a moment before the holder stops renewing it), LOST for any other stale token.
        """
        self._require_id(job_id)
        keys = self._lease_keys(job_id)
        reply = int(self._run("renew", keys, [job_id, str(lease_token), self._lease_ttl_ms]))
        return _RENEWALS.get(reply, Renewal.LOST)

    @redis_boundary
    def release_lease(self, job_id: str, lease_token: int) -> bool:
        """Give the lease up; False with a stale token (nothing done).

        A running job released is then reaped at once; a held queued job waits in no node.
        """
        self._require_id(job_id)
        return bool(self._run("release", self._lease_keys(job_id), [job_id, str(lease_token)]))

    @redis_boundary
    def lease_owner(self, job_id: str) -> str | None:
        """Owner of the live lease, or None."""
        self._require_id(job_id)
        held: str | None = self.redis.get(self.keys.lease(job_id))
        return held.split("|", 1)[1] if held else None

    @redis_boundary
    def reap_lapsed(self) -> list[str]:
        """The reaper's pass: running jobs whose lease lapsed go back to queued; their ids.

        One script finds them by the Redis clock (at most `_REAPER_BATCH` a call) and moves each
        as `reap` would (to canceled or paused when one is pending), so it applies once whoever
        runs it: every process may. The jobs are marked unpublished; the caller publishes them.
        """
        k = self.keys
        suffixes = [k.events_suffix, LEASE_SUFFIX, STOP_SUFFIX, WEBHOOKS_SUFFIX]
        args = [_REAPER_BATCH, k.job_prefix, *suffixes, *self._machine_settings()]
        reaped: list[str] = self._run("reap_lapsed", self._namespace_machine_keys(), args)
        return reaped

    @redis_boundary
    def reap(self, job_id: str) -> bool:
        """Running → queued if its lease is gone (→ canceled if a cancel is pending); True if so.

        (A delivery of a job still `running` whose holder is gone: tasks/node/jobs.py.) The job
        is marked unpublished: the caller publishes it again.
        """
        self._require_id(job_id)
        args = [job_id, *self._machine_settings()]
        return bool(self._run("reap", self._machine_keys(job_id), args))

    def cancel_requested(self, job_id: str) -> bool:
        """True while a cancel of the running job is pending (one GET; cheap)."""
        request = self.stop_requested(job_id)
        return request is not None and request.reason == StopReason.CANCELED

    @redis_boundary
    def stop_requested(self, job_id: str) -> StopRequest | None:
        """The running job's pending stop request (a cancel, a pause, a preemption), or None."""
        self._require_id(job_id)
        value: str | None = self.redis.get(self.keys.cancel(job_id))
        return read_stop(value) if value else None

    @redis_boundary
    def stops_requested(self, job_ids: Sequence[str]) -> dict[str, StopRequest]:
        """Which of these running jobs were asked to stop, and why: one MGET, one round trip.

        The node's cancel watch reads its jobs' requests with it every 20 ms, whatever they
        ask (a cancel, a pause, a priority preemption).
        """
        if not job_ids:
            return {}
        values: list[str | None] = self.redis.mget([self.keys.cancel(j) for j in job_ids])
        return {
            job_id: read_stop(value) for job_id, value in zip(job_ids, values, strict=True) if value
        }


class FeederLeaseOps(StoreBase):
    """Take and renew a batch's feeder lease (one feeder per batch at a time)."""

    @redis_boundary
    def take_feeder(self, batch_id: str, owner: str) -> int:
        """Take or keep the batch's feeder lease: its token; 0 if held elsewhere, -1 if ended."""
        keys = [self.keys.batch(batch_id), self.keys.batch_feeder(batch_id)]
        return int(self._run("batch_lease", keys, [owner, lease_ttl_ms(self.settings)]))
