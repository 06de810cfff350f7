"""`run_job(job_id)`: one delivery of one job on a GPU node (docs/contract.md §4-§5).

A delivery of a finished (or expired-away) job is dropped. A job leased by a live owner elsewhere
is published again after `lease_busy_delay_s`; a running job whose lease is gone is reaped and
taken over. A queued job whose spec this release cannot read (a newer release's version: tasks/
contract/job_spec.py), past its `start_by`, out of attempts or over this node's limits is
ended without running. Otherwise the node takes the lease and holds the job, still `queued`
(waiting in the node, with its position there), until its group starts it (tasks/node/
waiting.py; the start and its refusals: tasks/node/attempt.py). Every write after that is
fenced by the lease token, so a node that lost its lease can never overwrite the work of
the node that took over (the attempt itself: tasks/node/attempt.py). Each delivery is
acknowledged once, whatever it did; the Celery state it ends in says what that was
(tasks/node/outcomes.py: SUCCESS, FAILURE, REVOKED, RETRY).

In JSON logs every line of a delivery carries its `job_id`, and once the job runs its `attempt`
and `batch_id`; the node metrics count each attempt's stages (tasks/node/metrics.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from celery import Celery

from kiln.common.logs import log_context
from kiln.common.states import TERMINAL_STATES, JobState
from kiln.common.tracing import Carrier, message_carrier
from kiln.storage.errors import IllegalTransition, JobNotFound, LeaseHeld, StorageUnavailable
from kiln.storage.job_store import JobRecord
from kiln.storage.leases import delivery_owner
from kiln.tasks.contract.job_spec import JobSpecRefused
from kiln.tasks.contract.limits import ERROR_TYPE as LIMIT_ERROR
from kiln.tasks.node.attempt import LeasedAttempt
from kiln.tasks.node.attempt_trace import attempt_span
from kiln.tasks.node.compute import DeliveredJob
from kiln.tasks.node.node import Node
from kiln.tasks.node.outcomes import Delivery, DeliveryOutcome, JobFailedError, settle_task
from kiln.tasks.queue.app import RUN_JOB_TASK
from kiln.tasks.queue.submit import job_queue

log = logging.getLogger(__name__)

# An attempt that ends in one of these moved the job on in one script, which also dropped its
# lease (storage/lua/_machine.lua): releasing it again would only cost a round trip.
ENDED_WITH_A_TRANSITION = frozenset(
    {
        Delivery.SUCCEEDED,
        Delivery.FAILED,
        Delivery.CANCELED,
        Delivery.RETRYING,
        Delivery.HANDED_BACK,
        Delivery.PAUSED,
        Delivery.PREEMPTED,
    }
)


class JobRunner:
    """Runs one delivery of one job on this node."""

    def __init__(self, node: Node, job_id: str, trace: Carrier | None = None) -> None:
        self.node = node
        # the job's trace context as its message's headers carried it (else its record's)
        self.trace = dict(trace or {})
        self.store = node.store
        self.settings = node.settings
        self.job_id = job_id
        self.webhooks = False  # whether the job's spec asks for any (read once it is decoded)
        self.job: DeliveredJob | None = None  # the record's spec, decoded once (`_decoded`)
        self.outcome = DeliveryOutcome(Delivery.DROPPED)

    def run(self) -> DeliveryOutcome:
        """Handle the delivery; returns what it did (it never raises for the job's own fate).

        Redis away (a restart, a failover) before the delivery settled its job: the message is
        acknowledged all the same, so the job is owed another (tasks/queue/submit.py `owe`),
        published once Redis answers if it is still queued and not leased.
        """
        with log_context(job_id=self.job_id):
            try:
                self._run()
            except StorageUnavailable as exc:
                log.warning(
                    "job %s: %s; published again once Redis answers, if still queued",
                    self.job_id,
                    exc,
                )
                self.node.submitter.owe(self.job_id)
                self.outcome = DeliveryOutcome(Delivery.DEFERRED)
        return self.outcome

    def _run(self) -> None:
        try:
            record = self.store.get(self.job_id)
        except JobNotFound:
            log.warning("run_job: job %s does not exist (expired?); dropping", self.job_id)
            return
        with log_context(batch_id=record.batch_id):
            if record.state in TERMINAL_STATES:
                self._delivered_when_finished(record)
            elif record.state == JobState.RUNNING:
                self._delivered_while_running(record)
            elif record.state == JobState.PAUSED:
                # a message of a job paused while queued: its resume publishes a new one
                log.info("job %s is paused; delivery dropped", self.job_id)
            elif not self._refused_before_start(record):
                self._lease_and_run(record)

    def _delivered_when_finished(self, record: JobRecord) -> None:
        # A message of a job canceled (or expired) while queued still reaches a node: its task
        # is the job's, so it ends REVOKED as the job did.
        if record.state == JobState.CANCELED:
            self.outcome = DeliveryOutcome(Delivery.CANCELED)
        elif record.state == JobState.EXPIRED:
            self.outcome = DeliveryOutcome(Delivery.EXPIRED)
        log.info("job %s is %s already; delivery dropped", self.job_id, record.state)

    def _delivered_while_running(self, record: JobRecord) -> None:
        holder = self.store.lease_owner(self.job_id)
        if holder is not None:
            # A duplicate delivery (visibility timeout, redelivery): the holder finishes it.
            log.info("job %s delivered again while leased by %s; re-published", self.job_id, holder)
            self.node.submitter.publish(record, countdown=self.settings.lease_busy_delay_s)
            self.outcome = DeliveryOutcome(Delivery.DEFERRED)
        elif self.store.reap(self.job_id):
            record = self.store.get(self.job_id)
            if self._decoded(record):
                self._lease_and_run(record)

    def _decoded(self, record: JobRecord) -> bool:
        """Decode the job's spec: this delivery's one decode. False: it failed the job for good.

        A spec this release cannot read (a newer release's version) cannot become readable by
        waiting or by another attempt here, so the job fails, naming why, without running.
        """
        try:
            self.job = job = DeliveredJob.decode(record)
        except JobSpecRefused as exc:
            self._refuse(exc.error())
            return False
        self.webhooks = job.spec.webhook is not None
        return True

    def _refused_before_start(self, record: JobRecord) -> bool:
        if not self._decoded(record):
            return True
        job = self._job()
        start_by = job.spec.start_by
        if start_by is not None and time.time() > start_by:
            if self._transition_quietly(lambda: self.store.expire(self.job_id)):
                self.outcome = DeliveryOutcome(Delivery.EXPIRED)
                log.info("job %s expired: not started by its start_by", self.job_id)
            return True
        if record.attempts >= self.settings.max_attempts:
            error = {
                "type": "max_attempts_exceeded",
                "message": f"the job was started {record.attempts} times without finishing",
                "retryable": False,
            }
            self._refuse(error)
            return True
        return self._refused_over_limits(job) or self._refused_for_inputs(job)

    def _job(self) -> DeliveredJob:
        assert self.job is not None, "the spec is decoded before anything reads it"
        return self.job

    def _refuse(self, error: dict[str, Any]) -> None:
        """Fail the queued job for good without running it."""
        if self._transition_quietly(lambda: self.store.fail(self.job_id, None, error)):
            self.outcome = DeliveryOutcome(Delivery.FAILED, error)
            log.warning("job %s failed before it ran: %s", self.job_id, error["message"])

    def _refused_over_limits(self, job: DeliveredJob) -> bool:
        # Checked again here, not only at submit: a job may predate the limits or have been
        # accepted against another node's. Over them it fails alone, for good, before any rank
        # runs it, instead of taking the group down with it attempt after attempt.
        request = job.compute
        violation = self.node.over_limits(request.pipeline, request)
        if violation is None:
            return False
        error = {
            "type": LIMIT_ERROR,
            "message": violation.describe(),
            "retryable": False,
            "limit": violation.limit,
        }
        self._refuse(error)
        return True

    def _refused_for_inputs(self, job: DeliveredJob) -> bool:
        # Like the limits: the job may have been accepted against another node's schema.
        request = job.compute
        violation = self.node.bad_inputs(request.pipeline, request.extra_inputs)
        if violation is None:
            return False
        error = {"type": violation.kind, "message": violation.describe(), "retryable": False}
        self._refuse(error)
        return True

    def _lease_and_run(self, record: JobRecord) -> None:
        # One owner per delivery: a second delivery on this node must see LeaseHeld, not
        # silently take over (re-acquiring with the same owner would fence the first).
        if self._held_back(record):
            return
        owner = delivery_owner(self.node.node_id, uuid.uuid4().hex[:8])
        waiting = self.node.waiting
        try:
            # held, still queued: the group starts it when a batch takes it (attempt.py)
            position = waiting.next_position()
            token, record = self.store.hold(self.job_id, owner, self.node.node_id, position)
        except LeaseHeld:
            self.node.submitter.publish(record, countdown=self.settings.lease_busy_delay_s)
            self.outcome = DeliveryOutcome(Delivery.DEFERRED)
            return
        except IllegalTransition:
            return
        except JobNotFound:
            # gone since it was read: its creation never reached the replica promoted since
            # (its producer was answered 503 and creates it again) or its record expired
            log.warning("run_job: job %s is gone; dropping", self.job_id)
            return
        # every line from the hold on names the attempt this delivery makes (counted at its start)
        with (
            log_context(attempt=record.attempts + 1),
            self.node.tracking(self.job_id, token) as tracked,
        ):
            log.info("job %s held: waiting in the node at position %d", self.job_id, position)
            waiting.add(self.job_id, token)
            try:
                attempt = LeasedAttempt(
                    self.node,
                    record,
                    self._job(),
                    tracked,
                    webhooks=self.webhooks,
                )
                with attempt_span(self.store, self.node.node_id, record, self.trace):
                    self.outcome = attempt.run()
            finally:
                waiting.leave(self.job_id, token)  # one that never started leaves too
        self.node.progress.settle(self.job_id)  # once more: a lost lease ends on no transition
        if self.outcome.kind not in ENDED_WITH_A_TRANSITION:
            self.store.release_lease(self.job_id, token)

    def _held_back(self, record: JobRecord) -> bool:
        """A paused queue or an operator's drain: nothing starts here (tasks/node/controls.py)."""
        reason = self.node.holds_back(job_queue(record, self._job().spec))
        if reason is not None:
            self._defer(record, reason)
        return reason is not None

    def _defer(self, record: JobRecord, reason: str) -> None:
        """Publish the queued job again for later, as for a busy lease; its record is untouched."""
        self.node.submitter.publish(record, countdown=self.settings.lease_busy_delay_s)
        self.outcome = DeliveryOutcome(Delivery.DEFERRED)
        log.info("job %s not started now (%s); re-published", self.job_id, reason)

    def _transition_quietly(self, transition: Callable[[], JobRecord]) -> bool:
        """Run a transition out of `queued`; False when someone else moved the job first.

        The end goes through the node's sink like any other (its metrics, the job's webhooks).
        """
        try:
            after = transition()
        except IllegalTransition:
            return False  # someone else moved it first; nothing to do
        self.node.events.changed(after)
        return True


def register_run_job(app: Celery, node: Node) -> None:
    """Register `kiln.run_job` on the node worker's Celery app, bound to its `node`.

    The task closes over the node, so a delivery runs on the node that registered it and nothing
    process-wide holds one. `shared=False`: Celery would otherwise also add the task, node and
    all, to every Celery app this process creates later.
    """

    @app.task(
        name=RUN_JOB_TASK,
        bind=True,
        shared=False,
        ignore_result=True,
        acks_late=True,
        # A task that ends in FAILURE (or RETRY, or Ignore) is acknowledged like one that
        # returns: the job's outcome is stored already, a redelivery would only run it again.
        acks_on_failure=True,
        reject_on_worker_lost=True,
        throws=(JobFailedError,),  # a failed job is not an error of the worker: logged at INFO
        # each message is listed as held the moment the worker has it (tasks/node/held.py)
        Strategy="kiln.tasks.node.held:held_strategy",
        kiln_held=node.held,
    )
    def run_job(self: Any, job_id: str) -> str:
        """One delivery of `job_id`; its Celery state says what it did (node/outcomes.py)."""
        return settle_task(self, JobRunner(node, job_id, message_carrier(self.request)).run())
