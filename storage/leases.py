"""Every lease: a fencing token that grows on every acquire, a TTL, renewal, what a lapse means.

Two kinds, one shape (`<token>|<owner>` under a TTL of `lease_ttl_s`, storage/keys.py):

- a job's lease (`LeaseOps`): taken by the delivery that holds the job on a node
  (storage/lua/hold.lua; acquire.lua takes it too), renewed by the node's
  heartbeat (renew.lua; tasks/node/maintenance.py `renew_leases`: a lost lease stops the job),
  released at the end (release.lua). Once it lapses, the reaper (tasks/control/reaper.py) finds
  the job (lease_deadlines_passed.lua, `expired_leases`) and moves it back to queued (reap.lua,
  storage/transitions.py `reap`); every later write of the old attempt is fenced off by its token;
- a batch's feeder lease (`FeederLeaseOps`): taken and renewed by each feeder pass
  (batch_lease.lua); once it lapses, the next feeder pass anywhere takes the batch over, and the
  old feeder's fenced writes (batch_fed.lua, batch_reported.lua) are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

from kiln.common.job_events import ProgressData
from kiln.common.stops import StopReason
from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary
from kiln.storage.settings import StorageSettings

# a running job's stop request that asks for a pause (storage/lua/_machine.lua STOP_PAUSE); any
# other value is a cancel
_STOP_PAUSE = "pause"

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
    def expired_leases(self) -> list[str]:
        """Ids of running jobs whose lease has expired (by the Redis clock): reap candidates."""
        overdue: list[str] = self._run(
            "lease_deadlines_passed", [self.keys.running], [_REAPER_BATCH]
        )
        if not overdue:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in overdue:
            pipe.exists(self.keys.lease(job_id))
        alive = pipe.execute()
        return [job_id for job_id, live in zip(overdue, alive, strict=True) if not live]

    @redis_boundary
    def cancel_requested(self, job_id: str) -> bool:
        """True while a cancel of the running job is pending (one GET; cheap)."""
        self._require_id(job_id)
        flag = self.redis.get(self.keys.cancel(job_id))
        return bool(flag) and flag != _STOP_PAUSE

    @redis_boundary
    def stops_requested(self, job_ids: Sequence[str]) -> dict[str, StopReason]:
        """Which of these running jobs were asked to stop, and why (a cancel or a pause).

        One pipelined round trip: the job's stop request (`keys.cancel`, storage/lua/_machine.lua
        `STOP_CANCEL`/`STOP_PAUSE`) read for each.
        """
        if not job_ids:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.get(self.keys.cancel(job_id))
        flags = pipe.execute()
        return {
            job_id: StopReason.PAUSED if flag == _STOP_PAUSE else StopReason.CANCELED
            for job_id, flag in zip(job_ids, flags, strict=True)
            if flag
        }


class FeederLeaseOps(StoreBase):
    """Take and renew a batch's feeder lease (one feeder per batch at a time)."""

    @redis_boundary
    def take_feeder(self, batch_id: str, owner: str) -> int:
        """Take or keep the batch's feeder lease: its token; 0 if held elsewhere, -1 if ended."""
        keys = [self.keys.batch(batch_id), self.keys.batch_feeder(batch_id)]
        return int(self._run("batch_lease", keys, [owner, lease_ttl_ms(self.settings)]))
