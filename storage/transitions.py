"""State changes of a job: each public method is one run of a script in storage/lua/."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from redis.exceptions import NoScriptError, RedisError

from kiln.common.accounting import ATTEMPT_STEPS_FIELD, AttemptSteps
from kiln.common.job_events import (
    CanceledData,
    CanceledReason,
    ExpiredData,
    FailedData,
    PausedData,
    Payload,
    QueuedData,
    StartData,
    SucceededData,
)
from kiln.common.states import JobState, edge_sources
from kiln.storage.base import StoreBase, dumps, wait_command
from kiln.storage.boundary import redis_boundary, translate
from kiln.storage.errors import StorageError
from kiln.storage.leases import WAITING_IN_NODE, lease_ttl_ms, waiting_progress
from kiln.storage.records import JobRecord
from kiln.storage.scripts import ScriptCall, queue_by_sha

Q, R = JobState.QUEUED, JobState.RUNNING
# which sources each operation accepts; checked against TRANSITIONS at import
_START = edge_sources((Q,), R)
_SUCCEED = edge_sources((R,), JobState.SUCCEEDED)
_FAIL = edge_sources((Q, R), JobState.FAILED)
_REQUEUE = edge_sources((R,), Q)
_FINISH_CANCELED = edge_sources((R,), JobState.CANCELED)
_EXPIRE = edge_sources((Q,), JobState.EXPIRED)
_CANCEL_QUEUED = edge_sources((Q,), JobState.CANCELED)
P = JobState.PAUSED
_PAUSE_STOPPED = edge_sources((R,), P)
_EXPIRE_PAUSED = edge_sources((P,), JobState.EXPIRED)
# the edges cancel.lua (queued -> canceled) and reap.lua (running -> queued or canceled) take
# without reading the table: asserted in TRANSITIONS at import, so dropping one from the table
# fails here (the scripts themselves are not read: a script changed to take another edge is not)
edge_sources((Q,), JobState.CANCELED)
edge_sources((R,), Q)
edge_sources((R,), JobState.CANCELED)
# and those pause.lua (queued -> paused), resume.lua (paused -> queued), cancel.lua (paused ->
# canceled) and a pending pause (reap.lua, transition.lua's honor_cancel: running -> paused) take
edge_sources((Q, R), P)
edge_sources((P,), Q)
edge_sources((P,), JobState.CANCELED)


@dataclass(frozen=True)
class Start:
    """One held job to start (`start_many`): its lease token, its node, its key's running cap."""

    job_id: str
    lease_token: int
    node_id: str | None = None
    running_cap: int | None = None


class TransitionOps(StoreBase):
    """Fenced, atomic transitions of the state machine (kiln/common/states.py)."""

    def _transition(
        self,
        job_id: str,
        sources: tuple[JobState, ...],
        target: JobState,
        *,
        fence: str,
        token: int | None,
        payload: Payload,
        fields: dict[str, str] | None = None,
        honor_cancel: bool = False,
        running_cap: int | None = None,
    ) -> JobRecord:
        self._require_id(job_id)
        name, keys, args = self._transition_call(
            job_id,
            sources,
            target,
            fence=fence,
            token=token,
            payload=payload,
            fields=fields,
            honor_cancel=honor_cancel,
            running_cap=running_cap,
        )
        # a start or an end a replica has not got could be undone by a failover (run twice)
        reply = self._run_acknowledged(name, keys, args, strict=False)
        return self._record(job_id, reply)

    def _transition_call(
        self,
        job_id: str,
        sources: tuple[JobState, ...],
        target: JobState,
        *,
        fence: str,
        token: int | None,
        payload: Payload,
        fields: dict[str, str] | None = None,
        honor_cancel: bool = False,
        running_cap: int | None = None,
    ) -> ScriptCall:
        """The transition script call that `_transition` runs (keys and every argument).

        `payload` is the event's, typed (kiln/common/job_events.py); the script appends it.
        """
        flat = [item for pair in (fields or {}).items() for item in pair]
        args = [
            job_id,
            " " + " ".join(sources) + " ",
            target.value,
            fence,
            str(token or 0),
            dumps(payload.wire()),
            "1" if honor_cancel else "0",
            "" if running_cap is None else str(running_cap),
        ]
        k = self.keys
        keys = [*self._machine_keys(job_id), k.dead_letter_index, k.dead_letter(job_id)]
        dead = [
            k.dead_letter_prefix,
            k.dead_letter_owner_prefix,
            self.settings.dead_letter_retention_s,
            self.settings.dead_letter_max,
        ]
        return ("transition", keys, [*args, *self._machine_settings(), *dead, *flat])

    def _start_call(self, start: Start) -> ScriptCall:
        """The transition script call of `start` (what `start` runs)."""
        return self._transition_call(
            start.job_id,
            _START,
            R,
            fence="token",
            token=start.lease_token,
            payload=_start_payload(start.node_id),
            running_cap=start.running_cap,
        )

    @redis_boundary
    def start(
        self,
        job_id: str,
        lease_token: int,
        node_id: str | None = None,
        running_cap: int | None = None,
    ) -> JobRecord:
        """Queued → running (fenced): sets started_at, attempts + 1; the event names the node.

        The start of a held job (`hold`) as its group takes it; its waiting progress is cleared.

        With `running_cap`, QuotaExceeded (nothing written) while the job's owner has that many
        running jobs already: checked and counted in the same step, so the cap holds across nodes.
        """
        return self._transition(
            job_id,
            _START,
            R,
            fence="token",
            token=lease_token,
            payload=_start_payload(node_id),
            running_cap=running_cap,
        )

    @redis_boundary
    def start_many(self, starts: Sequence[Start]) -> list[JobRecord | StorageError]:
        """Start several held jobs (a batch its group takes) in one round trip.

        Each is what `start` does, on its own: its record, or the StorageError that refused it
        (StaleLease, IllegalTransition, QuotaExceeded, JobNotFound), in the order given. Where
        starts must reach replicas (`KILN_REDIS_MIN_REPLICAS_ACK`), each runs as `start` does.
        """
        for each in starts:
            self._require_id(each.job_id)
        if wait_command(self.settings) is not None or not starts:
            return [self._start_alone(each) for each in starts]
        pipe = self.redis.pipeline(transaction=False)
        queue_by_sha(pipe, [self._start_call(each) for each in starts])
        replies = pipe.execute(raise_on_error=False)
        results: list[JobRecord | StorageError] = []
        for each, reply in zip(starts, replies, strict=True):
            if isinstance(reply, NoScriptError):  # Redis lost its scripts: this one alone again
                results.append(self._start_alone(each))
            elif isinstance(reply, RedisError):
                results.append(translate(reply))
            else:
                results.append(self._record(each.job_id, reply))
        return results

    def _start_alone(self, start: Start) -> JobRecord | StorageError:
        try:
            return self.start(start.job_id, start.lease_token, start.node_id, start.running_cap)
        except StorageError as exc:
            return exc

    @redis_boundary
    def hold(self, job_id: str, owner: str, node_id: str, position: int) -> tuple[int, JobRecord]:
        """Lease the queued job for `owner`; it stays queued, waiting in node `node_id`.

        Returns (token, record). Its progress becomes `waiting_in_node` at `position` (jobs the
        node starts before it). Only the token's holder can start it (`start`). LeaseHeld
        (another owner's live lease) or IllegalTransition (not queued, or its batch was asked to
        stop) leave it as it was.
        """
        self._require_id(job_id)
        k = self.keys
        args = [
            job_id,
            owner,
            lease_ttl_ms(self.settings),
            dumps(waiting_progress(node_id, position).wire()),
            k.batch_prefix,
            self.settings.event_stream_maxlen,
        ]
        keys = [k.job(job_id), k.events(job_id), k.lease(job_id)]
        token, reply = self._run("hold", keys, args)
        return int(token), self._record(job_id, reply)

    @redis_boundary
    def set_progress(self, job_id: str, lease_token: int, progress: dict[str, Any]) -> None:
        """Record progress of a job whose lease the caller holds (fenced), with a `progress` event.

        A running job's stages; a queued (held) job's `waiting_in_node` only, which a job started
        meanwhile ignores.
        """
        self._require_id(job_id)
        k, maxlen = self.keys, self.settings.event_stream_maxlen
        waiting = "1" if progress.get("stage") == WAITING_IN_NODE else "0"
        self._run(
            "progress",
            [k.job(job_id), k.events(job_id)],
            [job_id, str(lease_token), dumps(progress), maxlen, waiting],
        )

    @redis_boundary
    def add_live_event(
        self, job_id: str, lease_token: int, event_type: str, payload: dict[str, Any]
    ) -> int:
        """Append a running job's `preview` or `output` event (fenced); returns its seq.

        A `preview` deletes the job's previous preview event: the stream keeps the newest only.
        """
        self._require_id(job_id)
        k, maxlen = self.keys, self.settings.event_stream_maxlen
        seq = self._run(
            "live_event",
            [k.job(job_id), k.events(job_id)],
            [job_id, str(lease_token), event_type, dumps(payload), maxlen],
        )
        return int(seq)

    @redis_boundary
    def succeed(
        self,
        job_id: str,
        lease_token: int,
        outputs: list[dict[str, Any]],
        metrics: dict[str, Any],
        steps: AttemptSteps | None = None,
    ) -> JobRecord:
        """Running → succeeded (fenced) with the verified outputs and the run's metrics.

        `steps`: what the attempt ran (its step accounting, kiln/common/accounting.py), as with
        `fail`, `requeue` and `finish_canceled`.
        """
        fields = {"outputs": dumps(outputs), "metrics": dumps(metrics), "error": "null"}
        return self._transition(
            job_id,
            _SUCCEED,
            JobState.SUCCEEDED,
            fence="token",
            token=lease_token,
            payload=SucceededData(outputs=outputs, metrics=metrics),
            fields=_with_steps(fields, steps),
        )

    @redis_boundary
    def fail(
        self,
        job_id: str,
        lease_token: int | None,
        error: dict[str, Any],
        metrics: dict[str, Any] | None = None,
        steps: AttemptSteps | None = None,
    ) -> JobRecord:
        """queued|running → failed; a running job needs its lease token, a queued one none."""
        fields = {"error": dumps(error)}
        if metrics is not None:
            fields["metrics"] = dumps(metrics)
        return self._transition(
            job_id,
            _FAIL,
            JobState.FAILED,
            fence="token" if lease_token is not None else "not_running",
            token=lease_token,
            payload=FailedData.model_validate({"error": error}),
            fields=_with_steps(fields, steps),
        )

    @redis_boundary
    def requeue(
        self,
        job_id: str,
        lease_token: int,
        error: dict[str, Any],
        steps: AttemptSteps | None = None,
    ) -> JobRecord:
        """Running → queued for a retry (fenced); → canceled instead if a cancel is pending.

        The job is marked unpublished: the caller publishes it again and calls mark_published.
        """
        return self._transition(
            job_id,
            _REQUEUE,
            Q,
            fence="token",
            token=lease_token,
            payload=QueuedData.model_validate({"reason": "retry", "error": error}),
            fields=_with_steps({"error": dumps(error)}, steps),
            honor_cancel=True,
        )

    @redis_boundary
    def cancel(self, job_id: str) -> JobRecord:
        """Cancel: queued or paused → canceled at once; running → cancel flag set; else as is."""
        return self._machine_call("cancel", job_id)

    @redis_boundary
    def pause(self, job_id: str) -> JobRecord:
        """Pause: queued → paused at once; running → pause requested; others unchanged.

        A running job's node stops it at its next step with a checkpoint (`pause_stopped`);
        one with a cancel pending keeps it (a cancel replaces a pause, never the reverse).
        Returns the record after the call.
        """
        return self._machine_call("pause", job_id)

    @redis_boundary
    def resume(self, job_id: str) -> JobRecord:
        """Resume: paused → queued at the back of its lane; a pending pause is withdrawn.

        The resumed job has a `resumed` event and is unpublished: the caller publishes it. Any
        other record is left unchanged.
        """
        return self._machine_call("resume", job_id)

    def _machine_call(self, name: Literal["cancel", "pause", "resume"], job_id: str) -> JobRecord:
        """Run cancel.lua, pause.lua or resume.lua on one job: the record after it."""
        self._require_id(job_id)
        args = [job_id, *self._machine_settings()]
        keys = self._machine_keys(job_id)
        return self._record(job_id, self._run_acknowledged(name, keys, args, strict=False))

    @redis_boundary
    def pause_stopped(
        self, job_id: str, lease_token: int, steps: AttemptSteps | None = None
    ) -> JobRecord:
        """Running → paused (fenced), once its node stopped the run its pause asked to stop.

        A cancel requested meanwhile wins: → canceled. `steps`: what the attempt ran.
        """
        return self._transition(
            job_id,
            _PAUSE_STOPPED,
            P,
            fence="token",
            token=lease_token,
            payload=PausedData(reason="pause_requested"),
            fields=_with_steps({}, steps),
            honor_cancel=True,
        )

    @redis_boundary
    def expire_paused(self, job_id: str) -> JobRecord:
        """Paused → expired (it stayed paused past KILN_PAUSED_RETENTION_S)."""
        return self._transition(
            job_id,
            _EXPIRE_PAUSED,
            JobState.EXPIRED,
            fence="none",
            token=None,
            payload=ExpiredData(reason="paused_retention"),
        )

    @redis_boundary
    def paused_past(self, retention_s: int, limit: int = 1000) -> list[str]:
        """Ids of jobs paused for more than `retention_s` (by the Redis clock), at most `limit`."""
        k = self.keys
        keys = [k.state_index(JobState.PAUSED)]
        due: list[str] = self._run("paused_past", keys, [k.job_prefix, retention_s, limit])
        return due

    @redis_boundary
    def cancel_queued(self, job_id: str, reason: CanceledReason) -> JobRecord:
        """Queued → canceled with the event payload `{reason}`; IllegalTransition otherwise.

        Unlike `cancel`, a running job is left alone (no cancel flag is set).
        """
        return self._transition(
            job_id,
            _CANCEL_QUEUED,
            JobState.CANCELED,
            fence="none",
            token=None,
            payload=CanceledData(reason=reason),
        )

    @redis_boundary
    def finish_canceled(
        self, job_id: str, lease_token: int, steps: AttemptSteps | None = None
    ) -> JobRecord:
        """Running → canceled (fenced), once the worker has stopped the job."""
        return self._transition(
            job_id,
            _FINISH_CANCELED,
            JobState.CANCELED,
            fence="token",
            token=lease_token,
            payload=CanceledData(reason="requested"),
            fields=_with_steps({}, steps),
        )

    @redis_boundary
    def expire(self, job_id: str) -> JobRecord:
        """Queued → expired (its start_by deadline passed)."""
        return self._transition(
            job_id, _EXPIRE, JobState.EXPIRED, fence="none", token=None, payload=ExpiredData()
        )


def _with_steps(fields: dict[str, str], steps: AttemptSteps | None) -> dict[str, str]:
    """An end's record fields with its attempt's steps (_machine.lua reads and removes them)."""
    return fields if steps is None else {**fields, ATTEMPT_STEPS_FIELD: steps.field()}


def _start_payload(node_id: str | None) -> StartData:
    """A start's part of its `running` event: the node, when it has one (the script adds more)."""
    return StartData(node_id=node_id) if node_id else StartData()
