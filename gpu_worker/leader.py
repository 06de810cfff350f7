"""What only rank 0 does around a forward: screen requests before, report the outcome after."""

from __future__ import annotations

from collections.abc import Mapping

from gpu_worker.errors import UnsupportedRequest
from gpu_worker.forward import ForwardResult, LeaderLink
from gpu_worker.pipelines import Pipeline
from gpu_worker.protocol import (
    BatchDone,
    BatchFailed,
    FailureKind,
    GenerationRequest,
    RankOutcome,
    RequestOutputs,
    RequestRejected,
    RunBatch,
    RunMetrics,
)
from gpu_worker.shm import FrameDescriptor, discard_frames, write_frames


class GroupBroken(RuntimeError):
    """A collective failed on some rank: the ranks are out of step and the group must go."""


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
    )
    if result.outputs is None:  # every request stopped
        all_ids = frozenset(request.request_id for request in batch.requests)
        link.send(BatchDone(batch.batch_id, (), all_ids, metrics))
        return
    try:
        outputs = _share_outputs(batch, result, stopped)
    except Exception as exc:
        link.send(BatchFailed(batch.batch_id, FailureKind.ERROR, f"shared memory: {exc}"))
        return
    link.send(BatchDone(batch.batch_id, outputs, stopped, metrics))


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
