"""Everything only rank 0 (the leader) does.

The coordinator's commands in, batches relayed to the followers, the per-step report and stop
decision, the batch's results out.

Rank 0 never waits on a user callback: it sends `StepDone(k)` and, at the end of step k+1, takes
the coordinator's `StopVerdict` for step k (waiting for it only if the coordinator is more than a
whole step behind, and then at most `verdict_wait_s`). Before a batch starts, rank 0 alone screens
its requests (a refused one never reaches a rank); after it, rank 0 gathers every rank's outcome
and reports one result, with frames in shared memory.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import replace
from multiprocessing.connection import Connection

import torch

from kiln.common.tracing import (
    DECODE_SPAN,
    DENOISE_SPAN,
    JOB_ID_ATTRIBUTE,
    STEP_EVENT,
    TEXT_ENCODING_SPAN,
    WAKE_SPAN,
    record_span,
    tracing_on,
)
from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.inputs import declared_input_schema, extra_inputs_refusal
from kiln.gpu_worker.pipelines import Pipeline
from kiln.gpu_worker.previews import LatentDecoder, PreviewTap, build_decoders
from kiln.gpu_worker.protocol import (
    BatchDone,
    BatchFailed,
    CoordinatorCommand,
    FailureKind,
    GenerationRequest,
    LeaderMessage,
    RankOutcome,
    RequestOutputs,
    RequestRejected,
    RunBatch,
    RunMetrics,
    ShutdownGroup,
    SleepGroup,
    StepDone,
    StopVerdict,
    WakeGroup,
)
from kiln.gpu_worker.ranks.forward import ForwardResult, StepSync, StopDecision, forward_batch
from kiln.gpu_worker.ranks.relay import broadcast_command, exchange_outcomes
from kiln.gpu_worker.ranks.sleep import sleep_rank, wake_rank
from kiln.gpu_worker.ranks.start import RankRuntime
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.gpu_worker.shm import FrameDescriptor, discard_frames, write_frames
from kiln.gpu_worker.speed import declared_refusal


class GroupBroken(RuntimeError):
    """A collective failed on some rank: the ranks are out of step and the group must go."""


class LeaderLink:
    """Rank 0's end of the coordinator's pipes: commands and verdicts in, messages out."""

    def __init__(self, commands: Connection, results: Connection, verdict_wait_s: float) -> None:
        self._commands = commands
        self._results = results
        self._verdict_wait_s = verdict_wait_s
        self._queued: deque[RunBatch | ShutdownGroup | SleepGroup] = deque()
        self._batch_id: int | None = None
        self._answered_step = 0
        self._reported_step = 0  # the newest step this batch reported (StepDone); 0: none yet
        self._stop_ids: set[str] = set()
        self._checkpoint_ids: set[str] = set()
        self._decided: tuple[int, frozenset[str]] | None = None  # (step, its stops), taken early

    def next_command(self) -> RunBatch | ShutdownGroup | SleepGroup:
        """Block (in the kernel, no polling) until the coordinator sends a batch or shutdown."""
        while not self._queued:
            self._take(self._commands.recv())
        return self._queued.popleft()

    def begin(self, batch_id: int) -> None:
        """Verdicts from now on are about this batch; earlier ones are stale."""
        self._batch_id, self._answered_step, self._stop_ids = batch_id, 0, set()
        self._reported_step, self._checkpoint_ids, self._decided = 0, set(), None

    def send(self, message: LeaderMessage) -> None:
        """Send one message to the coordinator."""
        self._results.send(message)

    def decide_stops(self, step: int, total: int) -> frozenset[str]:
        """End of `step` of the begun batch: report it, return the requests to stop now.

        At the last step, a request that would stop to resume elsewhere (`checkpoint_ids`: a
        drain, a pause, a preemption) goes on to its end instead: the last step's state is the
        output itself, of which no checkpoint is taken, so stopping there would lose every step.
        """
        assert self._batch_id is not None, "begin() the batch first"
        self.send(StepDone(self._batch_id, step, total))
        stops = self.stop_ids(step)
        self._reported_step = step
        return stops - self._checkpoint_ids if step >= total else stops

    def checkpoint_first(self, step: int) -> frozenset[str]:
        """Requests that stop at the end of `step` and take a step checkpoint of it first.

        Called before the step's checkpoint hook decides (ranks/checkpoints.py): it takes the
        step's stop decision now and `decide_stops` keeps it, so a verdict arriving in between
        cannot stop a request whose checkpoint was not taken (it counts at the next step).
        """
        stops = self.stop_ids(step)
        self._decided = (step, stops)
        return stops & self._checkpoint_ids

    def stop_ids(self, step: int) -> frozenset[str]:
        """Requests to stop at the end of `step`, once the verdict on the step before is in.

        The step before is the one this batch reported last: none at its first step, which for
        a run resumed from a checkpoint after step k is k + 1 (no verdict comes for the steps it
        skipped, so waiting for one would stall its first step `verdict_wait_s`).
        """
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        deadline = time.monotonic() + self._verdict_wait_s
        while True:
            while self._commands.poll(0):
                self._take(self._commands.recv())
            if self._answered_step >= self._reported_step:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._commands.poll(remaining):
                break  # a slow callback must not stall the group: decide with what we have
        return frozenset(self._stop_ids)

    def _take(self, command: CoordinatorCommand) -> None:
        if isinstance(command, StopVerdict):
            if command.batch_id == self._batch_id:
                self._stop_ids |= command.stop_ids
                self._checkpoint_ids |= command.checkpoint_ids
                self._answered_step = max(self._answered_step, command.after_step)
        else:
            self._queued.append(command)


class PreviewingStepSync(StepSync):
    """Rank 0's step callback when a request of the batch wants previews: it sees the latents."""

    def __init__(
        self, batch: RunBatch, runtime: RankRuntime, decide: StopDecision, tap: PreviewTap
    ):
        super().__init__(batch, runtime.control_group, decide)
        self._tap = tap

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Send the previews due after `step` (a `LatentsObserver`, see diffusers_call)."""
        self._tap.observe(step, total, latents)


def step_sync(
    runtime: RankRuntime,
    batch: RunBatch,
    link: LeaderLink,
    decoder: LatentDecoder | None,
    times: ForwardTimes | None = None,
) -> StepSync:
    """Rank 0's step callback for `batch`: previewing when a request wants previews.

    `times` (tracing on): notes when each step ended, for the requests' spans.
    """
    decide: StopDecision = link.decide_stops if times is None else times.timed(link.decide_stops)
    if decoder is not None:
        tap = PreviewTap(batch, decoder, link.send)
        if tap.wanted:
            return PreviewingStepSync(batch, runtime, decide, tap)
    return StepSync(batch, runtime.control_group, decide)


class ForwardTimes:
    """When a forward began, each step ended, and it ended: the spans of its requests.

    One forward runs requests of many traces: each gets its own `kiln.denoise` span (a child of
    its attempt's), with `kiln.text_encoding` up to the first step's end, a `step` event per
    step and `kiln.decode` after the last, all recorded once the forward is over (no span work
    between steps).
    """

    def __init__(self) -> None:
        self.began = time.time()
        self.steps: list[tuple[int, int, float]] = []

    def timed(self, decide: StopDecision) -> StopDecision:
        """`decide`, noting the end of each step first."""

        def noted(step: int, total: int) -> frozenset[str]:
            self.steps.append((step, total, time.time()))
            return decide(step, total)

        return noted

    def record(
        self, batch: RunBatch, outcome: RankOutcome, woke: tuple[float, float] | None
    ) -> None:
        """The spans of each request of the batch (and its wake, where the group woke for it)."""
        ended = time.time()
        events = [
            (STEP_EVENT, at, {"step": step, "total": total}) for step, total, at in self.steps
        ]
        first = self.steps[0][2] if self.steps else ended
        last = self.steps[-1][2] if self.steps else ended
        facts = {"kiln.batch_size": len(batch.requests), "kiln.status": outcome.status}
        for request in batch.requests:
            if woke is not None:
                record_span(WAKE_SPAN, request.trace, woke[0], woke[1])
            job = {JOB_ID_ATTRIBUTE: request.request_id, **facts}
            denoise = record_span(DENOISE_SPAN, request.trace, self.began, ended, job, events)
            record_span(TEXT_ENCODING_SPAN, denoise, self.began, first)
            if outcome.status == "ok":
                record_span(DECODE_SPAN, denoise, last, ended)


def lead(runtime: RankRuntime, link: LeaderLink, status: Connection) -> None:
    """Take commands from the coordinator, relay batches, report results, until shutdown."""
    args = runtime.args
    settings = args.settings or GpuWorkerSettings()
    decoders = build_decoders(runtime.pipelines, settings.preview_vae, runtime.device)
    while True:
        command = link.next_command()
        if isinstance(command, ShutdownGroup):
            _relay(runtime, command)
            return
        if isinstance(command, SleepGroup):
            _relay(runtime, command)
            link.send(sleep_rank(runtime, command.mode))
            continue
        if runtime.asleep is not None:
            _relay(runtime, WakeGroup())  # the followers wake alongside rank 0
        wake_s = wake_rank(runtime)  # before screening: a dropped pipeline cannot validate
        woke = (time.time() - wake_s, time.time()) if wake_s > 0 else None
        batch = screen_batch(command, runtime.pipelines, link)
        if batch is None:
            continue
        _relay(runtime, batch)
        link.begin(batch.batch_id)
        decoder = decoders.get(batch.requests[0].pipeline)
        times = ForwardTimes() if tracing_on() else None
        sync = step_sync(runtime, batch, link, decoder, times)
        result = forward_batch(runtime, batch, sync, status, link.send, link.checkpoint_first)
        if times is not None:
            times.record(batch, result.outcome, woke)
        outcome = replace(result.outcome, wake_s=wake_s)
        outcomes = exchange_outcomes(outcome, args.world_size, runtime.control_group)
        report_batch(link, batch, outcomes, result, sync.stopped)


def _relay(
    runtime: RankRuntime, command: RunBatch | ShutdownGroup | SleepGroup | WakeGroup
) -> None:
    """Pass a command on to the followers (a group of one has none)."""
    if runtime.idle_group is not None:
        broadcast_command(command, runtime.idle_group)


def screen_batch(
    batch: RunBatch, pipelines: Mapping[str, Pipeline], link: LeaderLink
) -> RunBatch | None:
    """Reject what the pipeline refuses (before any rank starts); None when nothing is left."""
    accepted: list[GenerationRequest] = []
    for request in batch.requests:
        reason = _refusal(request, pipelines)
        if reason is None:
            accepted.append(request)
        else:
            link.send(RequestRejected(batch.batch_id, request.request_id, reason))
    if accepted:
        return RunBatch(batch.batch_id, tuple(accepted))
    link.send(BatchDone(batch.batch_id, (), frozenset(), RunMetrics(0.0, 0.0, 0, 0)))
    return None


def _refusal(request: GenerationRequest, pipelines: Mapping[str, Pipeline]) -> str | None:
    pipeline = pipelines.get(request.pipeline)
    if pipeline is None:
        return f"pipeline: this group serves {sorted(pipelines)}, not {request.pipeline!r}"
    try:
        if request.extra_inputs:  # only what the pipeline declares is ever passed to it
            schema = declared_input_schema(pipeline)
            refusal = extra_inputs_refusal(request.pipeline, schema, request.extra_inputs)
            if refusal is not None:
                return refusal
        refusal = declared_refusal(request.pipeline, pipeline, request.speed)
        if refusal is not None:  # a pipeline that cannot run the mode never runs it as exact
            return refusal
        pipeline.validate(request)
    except UnsupportedRequest as exc:
        return str(exc)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def report_batch(
    link: LeaderLink,
    batch: RunBatch,
    outcomes: list[RankOutcome],
    result: ForwardResult,
    stopped: frozenset[str],
) -> None:
    """Tell the coordinator how the forward ended on all ranks; frames go through shm."""
    failed = [outcome for outcome in outcomes if outcome.status == "failed"]
    if any(outcome.kind is FailureKind.COLLECTIVE for outcome in failed):
        raise GroupBroken("; ".join(o.message for o in failed if o.kind is FailureKind.COLLECTIVE))
    if failed:
        kind = FailureKind.OOM if any(o.kind is FailureKind.OOM for o in failed) else failed[0].kind
        text = "\n".join(f"rank {o.rank}: {o.message}" for o in failed)
        link.send(BatchFailed(batch.batch_id, kind or FailureKind.ERROR, text))
        return
    metrics = RunMetrics(
        run_s=result.run_s,
        peak_memory_mb=max(outcome.peak_memory_mb for outcome in outcomes),
        steps_run=max(outcome.steps_run for outcome in outcomes),
        batch_size=sum(request.num_outputs for request in batch.requests),
        wake_s=max(outcome.wake_s for outcome in outcomes),  # the group waits for its last
        speed=result.speed,  # rank 0's: every rank ran the same mode
        resumed_at_step=result.resumed_at_step,  # alike on every rank (ranks/checkpoints.py)
        checkpoint_refusals=result.checkpoint_refusals,
    )
    if result.outputs is None:  # every request stopped
        all_ids = frozenset(request.request_id for request in batch.requests)
        link.send(BatchDone(batch.batch_id, (), all_ids, metrics, result.adapters))
        return
    try:
        outputs = _share_outputs(batch, result, stopped)
    except Exception as exc:
        link.send(BatchFailed(batch.batch_id, FailureKind.ERROR, f"shared memory: {exc}"))
        return
    link.send(BatchDone(batch.batch_id, outputs, stopped, metrics, result.adapters))


def _share_outputs(
    batch: RunBatch, result: ForwardResult, stopped: frozenset[str]
) -> tuple[RequestOutputs, ...]:
    assert result.outputs is not None
    written: list[FrameDescriptor] = []
    shared: list[RequestOutputs] = []
    try:
        for request, arrays in zip(batch.requests, result.outputs, strict=True):
            if request.request_id in stopped:
                continue
            frames: list[FrameDescriptor] = []
            for array in arrays:
                frames.append(write_frames(array))
                written.append(frames[-1])
            shared.append(RequestOutputs(request.request_id, tuple(frames)))
    except BaseException:
        for descriptor in written:
            discard_frames(descriptor)
        raise
    return tuple(shared)
