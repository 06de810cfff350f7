"""start_batch: the caller's one word on which requests of a batch start; the rest never run."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from kiln.common.stops import StopReason
from kiln.gpu_worker.errors import JobStopped
from kiln.gpu_worker.protocol import GenerationRequest, GenerationResult
from kiln.gpu_worker.tickets import Ticket, start_batch


def ticket(request_id: str) -> Ticket:
    request = GenerationRequest(
        request_id, "tiny", "a kiln", width=64, height=64, steps=2, seed=1, guidance_scale=0.0
    )
    future: Future[GenerationResult] = Future()
    future.set_running_or_notify_cancel()  # as `begin_running` leaves it
    return Ticket(request, future, 0.0)


def test_one_call_for_the_batch_and_the_refused_never_run() -> None:
    asked: list[list[str]] = []

    def batch_start(ids: Sequence[str]) -> set[str]:
        asked.append(list(ids))
        return {"a", "c"}

    batch = [ticket("a"), ticket("b"), ticket("c")]
    started = start_batch(batch, batch_start)
    assert asked == [["a", "b", "c"]]  # one call, the batch's order
    assert [t.request.request_id for t in started] == ["a", "c"]
    refused = batch[1]
    assert refused.stop_reason is StopReason.START_REFUSED
    with pytest.raises(JobStopped, match="refused its start"):
        refused.future.result(timeout=0)
    assert not started[0].future.done()


def test_a_failing_batch_start_starts_none() -> None:
    def batch_start(ids: Sequence[str]) -> set[str]:
        raise RuntimeError(f"Redis unreachable: {len(ids)} starts lost")

    batch = [ticket("a"), ticket("b")]
    assert start_batch(batch, batch_start) == []
    for each in batch:
        with pytest.raises(JobStopped):
            each.future.result(timeout=0)


def test_without_a_batch_start_every_request_starts() -> None:
    batch = [ticket("a")]
    assert start_batch(batch, None) == batch


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (StopReason.CANCELED, StopReason.CANCELED),  # the caller's own reason travels as is
        (StopReason.HANDED_BACK, StopReason.HANDED_BACK),
        (True, StopReason.REQUESTED),  # a plain yes: stopped on the caller's word
        (None, None),
        (False, None),
    ],
)
def test_should_stop_hands_the_callers_stop_reason_to_the_ticket(
    answer: StopReason | bool | None, reason: StopReason | None
) -> None:
    queued = ticket("q")
    queued.future = Future()  # still queued: `begin_running` decides
    queued.should_stop = lambda: answer
    assert queued.begin_running() is (reason is None)
    assert queued.stop_reason is reason
    if reason is not None:
        with pytest.raises(JobStopped, match="stopped while queued"):
            queued.future.result(timeout=0)
