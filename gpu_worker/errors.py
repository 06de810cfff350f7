"""The gpu_worker exception tree.

Two kinds of failure, two types: a request failed but the group is fine (`JobFailed` and its
subclasses), or the group itself must be rebuilt (`WorkerGroupDied`). Callers decide retry policy
from the `retryable` attribute alone.
"""

from __future__ import annotations


class GpuWorkerError(Exception):
    """Base of every error raised by gpu_worker."""

    retryable: bool = False


class JobFailed(GpuWorkerError):
    """This request failed; the group is healthy and keeps serving."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class UnsupportedRequest(JobFailed):
    """The pipeline cannot honour a field of the request (e.g. frames on an image model)."""


class OutOfMemory(JobFailed):
    """The device ran out of memory; the message says what to change. Not retryable."""


class DeadlineExceeded(JobFailed):
    """The request ran past its `max_run_seconds`."""


class JobStopped(GpuWorkerError):
    """The request was stopped because its `should_stop` callback said so; it has no outputs."""


class WorkerGroupDied(GpuWorkerError):
    """A rank died or the group broke; in-flight requests may be retried on a rebuilt group."""

    retryable = True


class RankStartupFailed(WorkerGroupDied):
    """A rank failed to start or load its pipeline; the message carries the rank's own error."""
