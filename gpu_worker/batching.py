"""Batching policy: which queued requests share the next forward, and how long to wait for more.

Requests are compatible when their `batch_key()` is equal (pipeline, size, frames, steps,
guidance); the pipelines generate every output from its own seeded generator, so a request's
pixels do not depend on its batch mates. A batch holds at most `max_batch` outputs (a request
with more outputs than that runs alone). The window only delays a batch that is not yet full and
whose oldest request arrived less than `window_s` ago: requests that queued up while the group
was busy go at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, TypeVar

from gpu_worker.protocol import GenerationRequest


class Queued(Protocol):
    """What the policy needs of a queued item."""

    @property
    def request(self) -> GenerationRequest:
        """The request waiting to run."""
        ...

    @property
    def enqueued_at(self) -> float:
        """`time.monotonic()` when it was submitted."""
        ...


Q = TypeVar("Q", bound=Queued)


def plan_batch(queue: Iterable[Q], max_batch: int) -> list[Q]:
    """The oldest request plus the later compatible ones that fit, oldest first."""
    chosen: list[Q] = []
    outputs = 0
    key: tuple[object, ...] | None = None
    for item in queue:
        request = item.request
        if key is None:
            key, outputs = request.batch_key(), request.num_outputs
            chosen.append(item)
        elif request.batch_key() == key and outputs + request.num_outputs <= max_batch:
            outputs += request.num_outputs
            chosen.append(item)
        if outputs >= max_batch:
            break
    return chosen


def batch_outputs(batch: Sequence[Queued]) -> int:
    """Outputs one forward of this batch computes."""
    return sum(item.request.num_outputs for item in batch)


def window_remaining(batch: Sequence[Queued], max_batch: int, window_s: float, now: float) -> float:
    """Seconds to wait for more compatible requests before sending `batch`; 0 means send now."""
    if not batch or batch_outputs(batch) >= max_batch:
        return 0.0
    return max(0.0, batch[0].enqueued_at + window_s - now)
