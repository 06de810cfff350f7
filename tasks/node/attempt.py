"""One attempt of a job whose lease a delivery of `run_job` holds (tasks/node/jobs.py).

The delivery holds the job still `queued` (waiting in the node: tasks/node/waiting.py). The
attempt fetches the job's image inputs and hands the request to the node's group; the job starts
(queued → running, fenced by the lease token, under its key's running cap and its start_by) only
as the group's batch takes it (`start_request`/`started`, on the coordinator's dispatcher thread,
the batch's starts in one round trip: `Node.start_batch`). A job that never
started here ends as its record says (canceled, expired, taken over) or goes back to its queue,
its attempts untouched (`_not_started`). A started attempt encodes and uploads the outputs, and
ends the job: succeeded; canceled, handed back or left to the lease's new holder
when it was told to stop; failed, or re-queued for a retry while attempts are left. Every Redis
write is fenced by the lease token and the outputs go to keys of the attempt's own, created never
replaced (tasks/node/output_uploads.py), so an attempt that lost its lease never overwrites the
work of the node that took over: the fenced `succeed` is what makes an attempt's outputs the job's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from kiln.common.accounting import AttemptSteps, StepTracker
from kiln.common.ledger import AttemptUsage
from kiln.common.previews import DEFAULT_PREVIEW_FORMAT
from kiln.common.request import pipeline_takes_checkpoints
from kiln.common.states import JobState
from kiln.common.stops import StopReason
from kiln.common.tracing import (
    ATTEMPT_ATTRIBUTE,
    JOB_ID_ATTRIBUTE,
    QUEUE_WAIT_SPAN,
    current_carrier,
    record_span,
)
from kiln.gpu_worker.errors import GpuWorkerError, JobStopped, OutOfMemory
from kiln.gpu_worker.inflight import CHECKPOINTED_STOPS
from kiln.gpu_worker.protocol import GenerationRequest, GenerationResult, StepProgress
from kiln.storage.base import AcknowledgementLost, ReplicasBehind
from kiln.storage.checkpoints import Checkpoints
from kiln.storage.dead_letters import DeadLetterStore
from kiln.storage.errors import IllegalTransition, StaleLease, StorageError
from kiln.storage.job_store import JobRecord
from kiln.storage.objects import new_attempt_name
from kiln.storage.transitions import Start
from kiln.tasks.contract.events import OutputPayload, ProgressData
from kiln.tasks.contract.views import output_url, with_storage_url
from kiln.tasks.node.checkpoints import CheckpointWriter, checkpoint_plan
from kiln.tasks.node.compute import DeliveredJob, run_metrics
from kiln.tasks.node.image_inputs import (
    FetchedImage,
    ImageInputRejected,
    fetch_job_images,
    input_facts,
    with_images,
)
from kiln.tasks.node.node import Node, TrackedJob
from kiln.tasks.node.outcomes import Delivery, DeliveryOutcome, describe_error
from kiln.tasks.node.output_uploads import discard_outputs, encode_and_upload
from kiln.tasks.node.poison import poison_reason, poisoned
from kiln.tasks.node.preempted import head_of_lane_message, preemption_ops
from kiln.tasks.node.previews import JobPreviews
from kiln.tasks.node.progress_writer import PendingPreview, PendingProgress
from kiln.tasks.queue.policy import error_dict, retry_delay

log = logging.getLogger(__name__)

# how often an end whose acknowledgement was lost with the primary runs again (each one waits
# for the new primary through the store's retry window)
_END_RERUNS = 3
# `requeue` honors a pending cancel or pause
_REQUEUED = frozenset({JobState.QUEUED, JobState.CANCELED, JobState.PAUSED})
_PAUSE_ENDS = frozenset({JobState.PAUSED, JobState.CANCELED})  # `pause_stopped` honors one too


class LeasedAttempt:
    """Runs one started attempt to its end; `run()` returns what the delivery did."""

    def __init__(
        self,
        node: Node,
        record: JobRecord,
        job: DeliveredJob,
        tracked: TrackedJob,
        *,
        webhooks: bool,
    ) -> None:
        self.node = node
        self.store = node.store
        self.settings = node.settings
        self.job_id = record.id
        self.record = record  # as `start` returned it: this attempt is counted
        self.job = job  # its spec, decoded once by the delivery (tasks/node/jobs.py)
        self.tracked = tracked
        # every event of this attempt goes through the node's sink; the job's webhooks hear them
        self.events = node.events.job(record.id, tracked.lease_token, webhooks)
        self.outcome = DeliveryOutcome(Delivery.DROPPED)
        self.expired_here = False  # `start_request` found its start_by passed and expired it
        preview = job.spec.preview
        preview_format = preview.format if preview is not None else DEFAULT_PREVIEW_FORMAT
        self.previews = JobPreviews(node.objects, record.id, preview_format)
        # this attempt's own folder in the object store: its outputs and its checkpoints
        self.attempt = new_attempt_name(tracked.lease_token)
        # the denoising steps it runs, reported with its end (kiln/common/accounting.py)
        self.denoised = StepTracker()
        self.result_steps: AttemptSteps | None = None  # its result's, once the group returns
        # its ledger figures (kiln/common/ledger.py), measured as it goes, reported with its end
        self.usage = AttemptUsage(pipeline=job.spec.pipeline, gpu_s=0.0)

    def run(self) -> DeliveryOutcome:
        """Generate and store the outputs; any failure ends the job (it never raises for it)."""
        try:
            self._generate_and_store()
        except JobStopped:
            if self.tracked.started:
                self._stopped()
            else:
                self._not_started()
        except GpuWorkerError as exc:
            if isinstance(exc, OutOfMemory):
                self.node.metrics.count_oom(self.job.spec.pipeline)
            self._failed(error_dict(exc), retryable=exc.retryable)
        except StaleLease:
            log.warning("job %s: lease lost to another node; leaving it to them", self.job_id)
            self.outcome = DeliveryOutcome(Delivery.LEASE_LOST)
        except StorageError as exc:
            self._failed(error_dict(exc), retryable=exc.retryable)
        except ImageInputRejected as exc:  # the job's own input: fails it, no traceback
            self._failed(error_dict(exc), retryable=False)
        except Exception as exc:  # a bug or a bad request: fail the job, never loop on it
            log.exception("job %s failed unexpectedly", self.job_id)
            self._failed(error_dict(exc), retryable=False)
        finally:
            # the attempt is over: its large preview goes, unless the job is another's now
            self.previews.close(delete=self.outcome.kind != Delivery.LEASE_LOST)
        return self.outcome

    def _generate_and_store(self) -> None:
        record, tracked = self.record, self.tracked
        # before compute: a refusal runs nothing
        images = fetch_job_images(self.node, self.job.spec, record.owner)
        self.node.adapter_sources.fetch(self.job.compute)  # store adapters, first use
        result = self._generate(images)
        started_at = self.record.started_at  # as its start left it
        if started_at is not None:
            waited = {JOB_ID_ATTRIBUTE: self.job_id, ATTEMPT_ATTRIBUTE: self.record.attempts}
            record_span(QUEUE_WAIT_SPAN, record.trace, record.created_at, started_at, waited)
        if tracked.stop_reason not in (None, *CHECKPOINTED_STOPS):
            raise JobStopped(tracked.stop_reason)
        # a stop that would resume the job elsewhere (a pause, a drain's hand-back, a preemption)
        # asked once every step ran comes too late to free the GPU: the job ends as it would have
        # (its end drops the stop request), rather than going back with its work lost (no
        # checkpoint is taken of the last step; the ranks run such a stop there to its end too)
        report = encode_and_upload(
            self.node.objects,
            self.job_id,
            self.job.spec,
            result.outputs,
            attempt=self.attempt,  # this attempt's own keys
            retry_for_s=self.settings.upload_retry_s,
            on_stage=lambda stage, step, total: self._progress(
                stage, step, total, on_task_thread=True
            ),
            on_retry=self.node.metrics.count_upload_retry,
            verify=self.settings.upload_verify,
            on_output=self._announce_output,
        )
        self.node.metrics.observe_stage("encode", report.encode_s)
        self.node.metrics.observe_stage("upload", report.upload_s)
        self.usage = replace(self.usage, encoding_s=report.encode_s, uploading_s=report.upload_s)
        # the record as its start left it (`started`): queue_s runs to the group's start
        started = self.record
        metrics: dict[str, Any] = {**run_metrics(started, result, report.encode_s, report.upload_s)}
        metrics.update(input_facts(images))  # what each image input was: sha256, size, source
        self.node.progress.settle(self.job_id)  # stages written; the terminal state ends them
        outputs = with_storage_url(report.outputs, self.node.storage_settings.storage_url)
        if not self._commit(outputs, metrics):
            return
        if self.record.checkpoints_recorded or tracked.checkpoints:  # none is needed now
            Checkpoints(self.store, self.node.objects).discard(self.job_id)
        self.outcome = DeliveryOutcome(Delivery.SUCCEEDED)
        # the timings as fields of a JSON line (queue_s, run_s, ...), not a dict in its text
        log.info("job %s succeeded", self.job_id, extra=metrics)
        self.events.changed(JobState.SUCCEEDED)

    def _commit(self, outputs: list[dict[str, Any]], metrics: dict[str, Any]) -> bool:
        """Make this attempt's outputs the job's: `succeed`, fenced by the lease token.

        False when the job ended elsewhere meanwhile. When the transition is refused (stale
        token, or the job is no longer running) the outputs are deleted: no record names them.
        An unanswered `succeed` (Redis unreachable) may have been applied: its outputs stay.
        """
        token = self.tracked.lease_token
        try:
            self._end(
                lambda: self.store.succeed(self.job_id, token, outputs, metrics, self._steps()),
                lambda record: record.state == JobState.SUCCEEDED and record.outputs == outputs,
            )
        except StaleLease:
            discard_outputs(self.node.objects, outputs)
            raise
        except IllegalTransition as exc:
            discard_outputs(self.node.objects, outputs)
            log.warning("job %s ended elsewhere while this attempt ran (%s)", self.job_id, exc)
            self.outcome = DeliveryOutcome(Delivery.DROPPED)
            return False
        return True

    def _generate(self, images: dict[str, FetchedImage]) -> GenerationResult:
        decoding_at: list[float] = []  # when the ranks reported the last denoising step
        tracked = self.tracked

        # Both callbacks run on the coordinator's threads between steps: memory only, no I/O.
        def on_progress(progress: StepProgress) -> None:
            if progress.preview is not None:
                self._preview(progress, progress.preview)
                return
            if progress.stage == "denoising":
                self.denoised.step(progress.step, time.monotonic())
            if progress.stage == "decoding" and not decoding_at:
                decoding_at.append(time.monotonic())
            self._progress(progress.stage, progress.step, progress.total)

        def should_stop() -> StopReason | None:
            return tracked.stop_reason  # set by heartbeat, cancel watch or drain

        max_run = self.job.spec.max_run_seconds
        request, writer = self._with_checkpoints(with_images(self.job.compute, images))
        # rank 0's spans are children of this attempt's (the current span), else of the job's
        request = replace(request, trace=current_carrier() or self.record.trace)
        submitted = time.monotonic()
        try:
            with self.node.starting(self.job_id, self):  # its batch starts it (`start_request`)
                future = self.node.submit(
                    request,
                    on_progress=on_progress,
                    should_stop=should_stop,
                    max_run_seconds=max_run,
                    on_checkpoint=writer.hand if writer is not None else None,
                )
                result = future.result()
        finally:
            if writer is not None and not writer.close():
                log.warning(  # its last checkpoint may be lost: the next attempt resumes older
                    "job %s: its checkpoint writer did not finish in time", self.job_id
                )
            self._charge(request.request_id, time.monotonic() - submitted)
        self._observe_compute(result, time.monotonic() - submitted, decoding_at)
        return result

    def _charge(self, request_id: str, with_group_s: float) -> None:
        """Its share of its batch's GPU-seconds and energy, once its group is done with it.

        Its time with the group is computing until `_observe_compute` splits it by the result's
        forward seconds (a failed or stopped run has no result: all of it counts as computing,
        or as loading when it never reached a forward).
        """
        gpu_s, energy_j = self.node.take_charge(request_id)
        ran = gpu_s > 0
        self.usage = replace(
            self.usage,
            gpu_s=gpu_s,
            energy_j=energy_j,
            computing_s=with_group_s if ran else 0.0,
            loading_s=0.0 if ran else with_group_s,
        )

    def _with_checkpoints(
        self, request: GenerationRequest
    ) -> tuple[GenerationRequest, CheckpointWriter | None]:
        """The request with its step checkpoints' plan, and their writer (node/checkpoints.py)."""
        checkpoints = Checkpoints(self.store, self.node.objects)
        offered: tuple[bytes, ...] = ()
        # The record as the hold read it names every checkpoint an earlier attempt recorded (none
        # can be recorded since: they are fenced by this attempt's lease token). A job that names
        # none, as most do, costs no read here, on the way to its group.
        if self.record.checkpoints_recorded:
            readable, _ = checkpoints.readable(self.job_id)  # the others are logged
            offered = tuple(data for _, data in readable)
        spec = self.job.spec
        resumable = pipeline_takes_checkpoints(self.node.pipeline_inputs(), spec.pipeline)
        plan = checkpoint_plan(spec, offered, self.settings.checkpoint_every_s, resumable=resumable)
        if plan is None:
            return request, None
        metrics, pipeline = self.node.metrics, spec.pipeline
        writer = CheckpointWriter(
            checkpoints,
            self.job_id,
            self.tracked.lease_token,
            self.attempt,
            on_written=lambda ref, seconds: metrics.observe_checkpoint(pipeline, seconds, ref.size),
        )
        self.tracked.checkpoints = True  # a stop checkpoints its step: it may be preempted
        return replace(request, checkpoint=plan), writer

    def start_request(self) -> Start | None:
        """This job's start as the group's batch takes it (the coordinator's dispatcher thread).

        None, and the job does not run: its start_by passed (it is expired now). Otherwise the
        node starts it with the batch's others, in one round trip (`Node.start_batch`).
        """
        self.node.waiting.leave(self.job_id)
        start_by = self.job.spec.start_by
        if start_by is not None and time.time() > start_by:
            try:
                self.store.expire(self.job_id)
                self.expired_here = True
                log.info("job %s expired: not started by its start_by", self.job_id)
            except StorageError as exc:  # canceled or ended meanwhile: `_not_started` reads it
                log.info("job %s not expired at its start: %s", self.job_id, exc)
            return None
        cap = self.node.running_caps.cap(self.record.owner)
        self.tracked.starting = True
        return Start(self.job_id, self.tracked.lease_token, self.node.node_id, cap)

    def started(self, result: JobRecord | StorageError) -> bool:
        """Queued → running happened (the record), or was refused (fenced by the lease, once).

        Refused, the job does not run here: its key is at its running cap, it was canceled or
        ended meanwhile, its batch was stopped, or the lease is another's; `_not_started` then
        reads what became of it.
        """
        if isinstance(result, ReplicasBehind):
            # nothing is computed on a start a failover could undo (docs/operations.md §15): it
            # stands once its lease lapses, or was lost and the job is queued again
            log.info(
                "job %s not started now (its start is not on a replica: %s)", self.job_id, result
            )
            return False
        if isinstance(result, StorageError):
            log.info("job %s not started here: %s", self.job_id, result)
            return False
        self.record = record = result
        self.tracked.started = True
        log.info(
            "job %s started: attempt %d on %s",
            self.job_id,
            record.attempts,
            self.job.spec.pipeline,
        )
        if record.started_at is not None:
            self.node.metrics.observe_stage("queue", record.started_at - record.created_at)
        self._announce_running()
        return True

    def _announce_running(self) -> None:
        """Tell the `running` event (the dispatcher thread, as the batch leaves for the ranks).

        The job's webhooks' enqueue writes to Redis, so it goes to the ordered thread (after it,
        the job's stages). Without webhooks the sink only tells the listeners (memory only):
        that is done here, since handing it to another thread would wake that thread just as the
        batch is sent to the ranks, and the two would share the interpreter then.
        """
        if self.events.webhooks:
            self.node.progress.call_soon(self.job_id, lambda: self.events.changed(JobState.RUNNING))
        else:
            self.events.changed(JobState.RUNNING)

    def _not_started(self, error: dict[str, Any] | None = None) -> None:
        """End a delivery whose job never started here, as its record now says.

        Ended (canceled while it waited, expired at its start, ended elsewhere): that is the
        outcome, nothing to write. Another's lease: left to them. Still this delivery's (a key
        at its running cap, the node draining, a retryable failure before the start): the lease
        goes and the job is published again, its attempts untouched (it never ran).
        """
        self.node.progress.discard(self.job_id)
        record = self.store.get(self.job_id)
        if record.state == JobState.CANCELED:
            self.outcome = DeliveryOutcome(Delivery.CANCELED)
            log.info("job %s canceled while it waited in the node", self.job_id)
        elif record.state == JobState.EXPIRED:
            self.outcome = DeliveryOutcome(Delivery.EXPIRED)
            if self.expired_here:
                self.events.changed(JobState.EXPIRED)
        elif record.state != JobState.QUEUED:
            self.outcome = DeliveryOutcome(Delivery.DROPPED)
            log.info("job %s is %s already; this delivery leaves it", self.job_id, record.state)
        elif not self.store.release_lease(self.job_id, self.tracked.lease_token):
            if self.store.lease_owner(self.job_id) is not None:
                self.outcome = DeliveryOutcome(Delivery.LEASE_LOST)
                log.warning("job %s: lease lost while it waited in the node", self.job_id)
                return
            # queued and nobody's: the hold was lost with a primary (a failover), and this
            # delivery's message is about to be acknowledged, so it goes out again here
            self.node.submitter.publish(record, countdown=self.settings.lease_busy_delay_s)
            self.outcome = DeliveryOutcome(Delivery.DEFERRED, error)
            log.info("job %s: its hold is gone (lost with a primary?); re-published", self.job_id)
        else:
            handed_back = self.tracked.stop_reason == StopReason.HANDED_BACK
            delay = 0.0 if handed_back else self.settings.lease_busy_delay_s
            self.node.submitter.publish(record, countdown=delay)
            self.outcome = DeliveryOutcome(Delivery.DEFERRED, error)
            if handed_back:
                why = "the node is draining"
            else:
                why = describe_error(error) if error else "its start was refused"
            log.info("job %s not started here (%s); re-published", self.job_id, why)

    def _observe_compute(
        self, result: GenerationResult, total_s: float, decoding_at: list[float]
    ) -> None:
        """Split the group's part of the attempt into load, denoise and decode."""
        if result.metrics is None:
            return
        # run_s is the forward on the ranks (denoising and decoding); the rest of the time since
        # the submit is "load": waiting for the group and the batch to start.
        run_s = min(result.metrics.run_s, total_s)
        decode_s = min(time.monotonic() - decoding_at[0], run_s) if decoding_at else 0.0
        ran, restored = result.metrics.steps_run, result.metrics.resumed_at_step
        # the steps' own pace, first step's report to last: the forward also holds the text
        # encoding and a resume's restore, which would inflate a short run's few steps (and the
        # seconds_lost they price); one step reported has no pace, and gets the forward's mean
        paced_s = self.denoised.steps().step_s
        step_s = paced_s if paced_s > 0 else ((run_s - decode_s) / ran if ran else 0.0)
        self.result_steps = AttemptSteps(restored, restored + ran, step_s)
        self.usage = replace(self.usage, loading_s=total_s - run_s, computing_s=run_s)
        self.node.metrics.observe_stage("load", total_s - run_s)
        self.node.metrics.observe_stage("denoise", run_s - decode_s)
        self.node.metrics.observe_stage("decode", decode_s)
        self.node.metrics.observe_wake(result.metrics.wake_s)

    def _progress(self, stage: str, step: int, total: int, on_task_thread: bool = False) -> None:
        tracked = self.tracked
        tracked.last_progress_at = time.time()
        changed = stage != tracked.last_stage or step == total
        tracked.last_stage = stage
        pending = PendingProgress(self.events, ProgressData(stage=stage, step=step, total=total))
        if on_task_thread:  # encoding/uploading: each written, in order, as the work goes on
            self.node.progress.write_soon(self.job_id, pending)
        else:
            self.node.progress.update(self.job_id, pending, urgent=changed)

    def _preview(self, progress: StepProgress, pixels: np.ndarray) -> None:
        """Hand the newest preview to the progress writer, which encodes and appends it."""
        previews, step, total = self.previews, progress.step, progress.total
        self.node.progress.preview(
            self.job_id, PendingPreview(self.events, lambda: previews.payload(step, total, pixels))
        )

    def _announce_output(self, index: int, entry: dict[str, Any]) -> None:
        """An `output` event for one stored and verified output, before the job's end."""
        located = with_storage_url([entry], self.node.storage_settings.storage_url)[0]
        url = output_url(located, self.node.objects)
        self.node.progress.event_soon(self.events, OutputPayload(index=index, url=url, **entry))

    def _stopped(self) -> None:
        self.node.progress.settle(self.job_id)
        token = self.tracked.lease_token
        reason = self.tracked.stop_reason
        if reason == StopReason.CANCELED:
            self._end(
                lambda: self.store.finish_canceled(self.job_id, token, self._steps()),
                lambda record: record.state == JobState.CANCELED,
            )
            self.outcome = DeliveryOutcome(Delivery.CANCELED)
            log.info("job %s canceled while running", self.job_id)
            self.events.changed(JobState.CANCELED)
        elif reason == StopReason.PAUSED:
            self._paused(token)
        elif reason == StopReason.PREEMPTED:
            self._preempted(token)
        elif reason == StopReason.HANDED_BACK:
            error = {"type": "handed_back", "message": "the node shut down", "retryable": True}
            self._publish_requeued(self._requeue(token, error))
            self.outcome = DeliveryOutcome(Delivery.HANDED_BACK, error)
            log.info("job %s handed back to the queue (the node is draining)", self.job_id)
        else:
            log.warning("job %s stopped after its lease was lost", self.job_id)
            self.outcome = DeliveryOutcome(Delivery.LEASE_LOST)

    def _publish_requeued(self, record: JobRecord, countdown: float = 0.0) -> None:
        """Publish a job its attempt sent back to the queue.

        A pending cancel or pause ended it canceled or paused instead (`requeue`): no message, its
        change is announced.
        """
        if record.state == JobState.QUEUED:
            self.node.submitter.publish(record, countdown=countdown)
        else:
            self.events.changed(record.state)

    def _paused(self, token: int) -> None:
        """Its pause stopped the run at a step boundary: running → paused, lease and GPU free.

        The stop took a checkpoint of that step when the run takes them (gpu_worker/inflight.py
        CHECKPOINTED_STOPS); a cancel requested meanwhile ends it canceled instead.
        """
        record = self._end(
            lambda: self.store.pause_stopped(self.job_id, token, self._steps()),
            lambda record: record.state in _PAUSE_ENDS,
        )
        state = record.state if record.state in _PAUSE_ENDS else JobState.PAUSED
        kind = Delivery.CANCELED if state == JobState.CANCELED else Delivery.PAUSED
        self.outcome = DeliveryOutcome(kind)
        log.info("job %s %s while running", self.job_id, state)
        self.events.changed(state)

    def _preempted(self, token: int) -> None:
        """Suspended for a waiting interactive job: queued at the head of its lane, not counted.

        Its stop checkpointed the step it stopped at (gpu_worker/inflight.py CHECKPOINTED_STOPS),
        so its next attempt recomputes nothing; a cancel or pause requested meanwhile ends it so.
        """
        ops = preemption_ops(self.node)
        message = head_of_lane_message(self.node, self.record)
        for_job = self.tracked.preempted_for
        record = self._end(
            lambda: ops.requeue_preempted(self.job_id, token, for_job, message, self._steps()),
            lambda record: record.state in _REQUEUED,
        )
        if record.state != JobState.QUEUED:
            self.outcome = DeliveryOutcome(Delivery(record.state.value))
            log.info("job %s %s as it was preempted", self.job_id, record.state)
            self.events.changed(record.state)
            return
        if not record.published:  # no message built here: at the back of the broker's list
            self.node.submitter.publish(record)
        self.node.metrics.count_preemption(self.job.spec.pipeline)
        self.outcome = DeliveryOutcome(Delivery.PREEMPTED)
        log.info(
            "job %s preempted for job %s: queued at the head of its lane", self.job_id, for_job
        )

    def _failed(self, error: dict[str, Any], *, retryable: bool) -> None:
        self.node.progress.settle(self.job_id)
        if retryable and not self.tracked.started:
            self._not_started(error)  # it never ran: back to its queue, no attempt spent
            return
        token = self.tracked.lease_token
        attempts = self.record.attempts
        self.node.quarantine.note(self.job_id, error)  # a device failing many jobs stops taking
        reason = poison_reason(error, lambda: self._dead_letters().attempt_log(self.job_id))
        if reason is not None:  # never tried again: a third run would break its group again
            error, retryable = poisoned(error, reason), False
        if retryable and attempts < self.settings.max_attempts:
            requeued = self._requeue(token, error)
            delay = retry_delay(attempts, self.settings)
            self._publish_requeued(requeued, countdown=delay)
            self.outcome = DeliveryOutcome(Delivery.RETRYING, error, delay)
            log.info("job %s: retryable failure, retry %d in %.1fs", self.job_id, attempts, delay)
            return
        error = {**error, "retryable": False} if retryable else error
        self._end(
            lambda: self.store.fail(self.job_id, token, error, steps=self._steps()),
            lambda record: record.state == JobState.FAILED and record.error == error,
        )
        self.outcome = DeliveryOutcome(Delivery.FAILED, error)
        log.warning("job %s failed: %s: %s", self.job_id, error.get("type"), error.get("message"))
        self.events.changed(JobState.FAILED)

    def _dead_letters(self) -> DeadLetterStore:
        return DeadLetterStore(self.store.redis, self.store.settings)

    def _requeue(self, token: int, error: dict[str, Any]) -> JobRecord:
        """Back to the queue for another attempt (canceled instead if a cancel is pending)."""
        return self._end(
            lambda: self.store.requeue(self.job_id, token, error, self._steps()),
            lambda record: record.state in _REQUEUED and record.error == error,
        )

    def _steps(self) -> AttemptSteps:
        """What this attempt ran, for its end, with its ledger figures (kiln/common/ledger.py).

        Its steps are its result's figures, or its progress's.
        """
        steps = self.result_steps if self.result_steps is not None else self.denoised.steps()
        return replace(steps, usage=self.usage.as_dict())

    def _end(
        self, end: Callable[[], JobRecord], ended_here: Callable[[JobRecord], bool]
    ) -> JobRecord:
        """Run a fenced end of this attempt until a replica has it (docs/operations.md §15).

        AcknowledgementLost (the primary was lost while its replicas were awaited): the end
        may be on the promoted replica or gone with the old primary; it runs again, fenced by
        the lease, so it applies once. A refusal (StaleLease, IllegalTransition) of a job whose
        record shows this very end (`ended_here`) means an earlier send applied it (a rerun,
        or redis-py's resend of a call whose reply was lost): the end is this attempt's.
        ReplicasBehind past the hold: the end stands on the primary that answered, which is
        still up; it is reported, with the risk logged.
        """
        for rerun in range(_END_RERUNS + 1):
            try:
                return end()
            except AcknowledgementLost as lost:
                if rerun == _END_RERUNS:
                    raise
                log.warning("job %s: end not confirmed (%s); running it again", self.job_id, lost)
            except ReplicasBehind as behind:
                log.error("job %s: its end is on the primary only: %s", self.job_id, behind)
                return self.store.get(self.job_id)
            except (StaleLease, IllegalTransition):
                record = self.store.get(self.job_id)
                if not ended_here(record):
                    raise
                return record
        raise AssertionError("unreachable: the last rerun returns or raises")
