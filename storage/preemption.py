"""Priority preemption's reads and writes (docs/operations.md §20).

The control room (tasks/control/preemption.py) reads the oldest waiting jobs of a queue
(`waiting`) and the running jobs of some queues (`running_in`), and asks for a preemption with
`request_preemption` (storage/lua/preempt_request.lua: the guard and a claim per waiting job, in
one step, so control processes deciding at once ask once). The ask is the running job's stop
request, the one a cancel and a pause write (storage/leases.py `StopRequest`), so its node's
cancel watch reads it with the others in the same read (`stops_requested`); the node stops the
job at its next step boundary with a checkpoint and ends the run with `requeue_preempted`
(storage/lua/preempted.lua): queued at the head of its lane, its attempt not counted,
`preemptions` and `preempted_at` on its record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.common.accounting import ATTEMPT_STEPS_FIELD, AttemptSteps
from kiln.common.job_events import PreemptedData, QueuedData
from kiln.storage.base import dumps
from kiln.storage.boundary import redis_boundary
from kiln.storage.leases import preemption_stop
from kiln.storage.records import JobRecord
from kiln.storage.transitions import TransitionOps


@dataclass(frozen=True)
class WaitingJob:
    """A queued job at the head of its queue: since when, and the node holding it (if any)."""

    job_id: str
    created_at: float
    holder: str | None  # the node id whose delivery holds it (waiting in that node), or None


@dataclass(frozen=True)
class RunningJob:
    """A running job as the preemption decision reads it."""

    job_id: str
    queue: str
    node: str | None  # the node id holding its lease
    started_at: float  # its latest attempt's start
    preemptions: int


def _node_of(lease_owner: str | None) -> str | None:
    """The node id of a lease owner `<node id>/<delivery>` (storage/leases.py)."""
    if not lease_owner:
        return None
    return lease_owner.rpartition("/")[0] or lease_owner


class PreemptionOps(TransitionOps):
    """Read what the preemption decision needs; ask for a preemption; end a preempted run."""

    @redis_boundary
    def waiting(self, queue: str, limit: int) -> list[WaitingJob]:
        """The first `limit` jobs of `queue`'s index (its head first), with their holders."""
        ids: list[str] = self.redis.zrange(self.keys.queue_index(queue), 0, limit - 1)
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hget(self.keys.job(job_id), "created_at")
            pipe.get(self.keys.lease(job_id))
        replies = pipe.execute()
        out = []
        for job_id, created, lease in zip(ids, replies[0::2], replies[1::2], strict=True):
            if created is None:  # gone meanwhile
                continue
            holder = _node_of(lease.partition("|")[2]) if lease else None
            out.append(WaitingJob(job_id, float(created), holder))
        return out

    @redis_boundary
    def running_in(self, queues: Sequence[str] | None) -> list[RunningJob]:
        """Every running job whose queue is one of `queues` (None: any), from the running set."""
        wanted = None if queues is None else set(queues)
        ids: list[str] = self.redis.zrange(self.keys.running, 0, -1)
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(
                self.keys.job(job_id), "queue", "lease_owner", "started_at", "preemptions", "state"
            )
        out = []
        for job_id, (queue, owner, started, preemptions, state) in zip(
            ids, pipe.execute(), strict=True
        ):
            if (wanted is not None and queue not in wanted) or state != "running" or not started:
                continue
            node = _node_of(owner)
            out.append(RunningJob(job_id, queue or "", node, float(started), int(preemptions or 0)))
        return out

    @redis_boundary
    def request_preemption(
        self, job_id: str, for_job: str, *, cap: int, min_run_s: float, ttl_s: float
    ) -> bool:
        """Ask `job_id`'s node to suspend it for `for_job`; False when the guard refuses.

        The ask is the job's stop request (`StopRequest` PREEMPTED, naming `for_job`). Refused
        with nothing written: the job is not running, a stop of it (a cancel, a pause, a
        preemption) is pending, it was preempted `cap` times, it ran less than `min_run_s`
        since its latest start, or a preemption is claimed for `for_job` already (the request
        and the claim live `ttl_s`; a node that does not carry it out lets it lapse).
        """
        self._require_id(job_id)
        self._require_id(for_job)
        k = self.keys
        keys = [k.job(job_id), k.cancel(job_id), k.preempt_claim(for_job)]
        args = [job_id, preemption_stop(for_job), cap, min_run_s, max(1, int(ttl_s * 1000))]
        return bool(self._run("preempt_request", keys, args))

    @redis_boundary
    def requeue_preempted(
        self,
        job_id: str,
        lease_token: int,
        for_job: str | None,
        message: tuple[str, str] | None = None,
        steps: AttemptSteps | None = None,
    ) -> JobRecord:
        """Running → queued at the head of its lane (fenced), its attempt not counted.

        `message`: the job's `run_job` message and the list key kombu keeps its queue in
        (tasks/queue/messages.py), pushed where the queue's next fetch pops first; the job is
        then published. Without it the job is left unpublished: the caller publishes it (at the
        back of the broker's list). Its stop request ends with the run; a cancel or a pause
        that replaced the preemption meanwhile ends it as that stop says.
        `steps`: what the attempt ran, for its accounting (storage/lua/_machine.lua).
        """
        self._require_id(job_id)
        list_key, body = message if message is not None else ("", "")
        keys = [*self._machine_keys(job_id), list_key]
        args = [
            job_id,
            str(lease_token),
            dumps(QueuedData(reason="preempted").wire()),
            dumps(PreemptedData(for_job=for_job).wire()),
            body,
            *self._machine_settings(),
            *([ATTEMPT_STEPS_FIELD, steps.field()] if steps is not None else []),
        ]
        return self._record(job_id, self._run_acknowledged("preempted", keys, args, strict=False))

    @redis_boundary
    def preemption_count(self, job_id: str) -> tuple[int, float | None]:
        """How many times the job was preempted, and when last (None: never)."""
        count, at = self.redis.hmget(self.keys.job(job_id), "preemptions", "preempted_at")
        return int(count or 0), float(at) if at else None
