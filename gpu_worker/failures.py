"""How a failure on the ranks becomes the caller's exception (the types in `gpu_worker.errors`).

An out-of-memory failure gets a message that says what to change. A request whose group died
under it fails with the error of the rank that failed on its own first, when one did: the death
only followed from it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kiln.common.stops import StopReason
from kiln.gpu_worker.errors import GpuWorkerError, JobFailed, OutOfMemory, WorkerGroupDied
from kiln.gpu_worker.protocol import FailureKind, GenerationRequest, RankFault
from kiln.gpu_worker.tickets import Ticket

log = logging.getLogger(__name__)

OOM_ADVICE = (
    "Out of memory while generating {what}. The request does not fit on this worker group as it "
    "is; try one or more of: a lower width/height, fewer num_frames, fewer num_outputs, a smaller "
    "batch (max_batch) on this node, enabling CPU offload for the model, or a group with more "
    "GPUs (batch or context parallelism spreads the work). Device error: {detail}"
)


def describe_request(request: GenerationRequest) -> str:
    """'2 output(s) of 512x512, 16 frame(s), 30 steps' — for error messages."""
    return (
        f"{request.num_outputs} output(s) of {request.width}x{request.height}, "
        f"{request.num_frames} frame(s), {request.steps} steps"
    )


def failure_error(kind: FailureKind, message: str, request: GenerationRequest) -> GpuWorkerError:
    """The caller's exception for a forward that failed with `kind` on the ranks."""
    if kind is FailureKind.OOM:
        detail = message.strip().splitlines()[-1] if message.strip() else "out of memory"
        return OutOfMemory(OOM_ADVICE.format(what=describe_request(request), detail=detail))
    # the ranks' traceback stays in the node's log; the job's error gets the exception raised
    log.warning("a forward of %s failed on the ranks:\n%s", describe_request(request), message)
    if kind is FailureKind.COLLECTIVE:
        return WorkerGroupDied(f"the worker group broke during the forward: {_last_line(message)}")
    return JobFailed(f"the pipeline failed: {_last_line(message)}")


def death_error(ticket: Ticket, faults: Sequence[RankFault], reason: str) -> GpuWorkerError:
    """The error of an in-flight request whose group died (or was killed) under it.

    `faults` are what the ranks reported about its batch before the death.
    """
    if ticket.stop_reason is StopReason.DEADLINE:
        return ticket.stopped_error()
    cause = next((f for f in faults if f.kind is not FailureKind.COLLECTIVE), None)
    if cause is not None:  # a rank failed on its own first; the death followed from it
        return failure_error(cause.kind, f"rank {cause.rank}: {cause.message}", ticket.request)
    fatal = [f"rank {f.rank}: {_last_line(f.message)}" for f in faults if f.fatal]
    details = "".join(f"\n{line}" for line in fatal)
    return WorkerGroupDied(f"the worker group died: {reason}{details}")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no message)"
