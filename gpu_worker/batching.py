"""What goes to the group next: the requests waiting for it, and which of them share a forward.

Requests are compatible when their `batch_key()` is equal (pipeline, size, frames, steps,
guidance, inputs, adapters, speed mode: modes never share a forward); the pipelines generate
every output from its own seeded generator, so in `exact` mode a request's pixels do not depend
on its batch mates (in a faster mode the cache's skip decision is taken over the whole batch).
A batch holds at most `max_batch` outputs (a request with more outputs than that runs alone, as
does one with step checkpoints), fewer when its pipeline's memory budget says so. The window only
delays a batch that is not yet full and whose oldest request arrived less than `window_s` ago:
requests that queued up while the group was busy go at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, TypeVar

from kiln.common.limits import DeclaredLimits
from kiln.common.stops import StopReason
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.tickets import Ticket


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
            if request.checkpoint is not None:
                break  # a checkpoint is one job's state: it runs alone
        elif (
            request.checkpoint is None
            and request.batch_key() == key
            and outputs + request.num_outputs <= max_batch
        ):
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
    if not batch or batch_outputs(batch) >= max_batch or batch[0].request.checkpoint is not None:
        return 0.0  # full, or one that runs alone
    return max(0.0, batch[0].enqueued_at + window_s - now)


class WaitingRequests:
    """Submitted requests not yet sent to the group, oldest first.

    Not thread-safe on its own: the coordinator calls it under its lock.
    """

    def __init__(self, max_batch: int, window_s: float) -> None:
        self._max_batch = max_batch
        self._window_s = window_s
        self._tickets: deque[Ticket] = deque()

    def __len__(self) -> int:
        return len(self._tickets)

    def add(self, ticket: Ticket) -> None:
        """Queue a ticket behind the others."""
        self._tickets.append(ticket)

    def holds(self, request_id: str) -> bool:
        """True when a request with this id is waiting."""
        return any(t.request.request_id == request_id for t in self._tickets)

    def expire(self, now: float) -> None:
        """Drop cancelled tickets; fail those whose deadline passed before they could start."""
        for ticket in [t for t in self._tickets if t.future.done() or t.expired(now)]:
            self._tickets.remove(ticket)
            if not ticket.future.cancelled():
                ticket.stop_reason = StopReason.DEADLINE
                ticket.fail(ticket.expired_in_queue_error())

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting request (when `expire` next has work); None: none."""
        deadlines = [t.deadline_at for t in self._tickets if t.deadline_at is not None]
        return min(deadlines) if deadlines else None

    def take_batch(
        self, now: float, limits: Mapping[str, DeclaredLimits]
    ) -> tuple[list[Ticket], float | None]:
        """The batch to send now (taken out of the queue), or none and when to look again."""
        max_outputs = self._batch_cap(limits)
        planned = plan_batch(self._tickets, max_outputs)
        next_deadline = self.next_deadline()
        if not planned:
            return [], next_deadline
        wait_s = window_remaining(planned, max_outputs, self._window_s, now)
        if wait_s > 0:
            return [], min(now + wait_s, next_deadline or float("inf"))
        for ticket in planned:
            self._tickets.remove(ticket)
        return planned, None

    def drain(self) -> list[Ticket]:
        """Take every waiting ticket out, oldest first."""
        tickets = list(self._tickets)
        self._tickets.clear()
        return tickets

    def _batch_cap(self, limits: Mapping[str, DeclaredLimits]) -> int:
        """Outputs the next batch may hold: `max_batch`, within its pipeline's memory budget."""
        # Requests that each fit the declared budget (pixels × frames × outputs) must not add up
        # to a forward that does not; a first request over it still runs, alone.
        if not self._tickets:
            return self._max_batch
        oldest = self._tickets[0].request  # plan_batch builds the batch around it
        budget = limits.get(oldest.pipeline, {}).get("max_pixels_frames_outputs")
        if budget is None:
            return self._max_batch
        per_output = oldest.width * oldest.height * oldest.num_frames
        return max(1, min(self._max_batch, budget // max(1, per_output)))
