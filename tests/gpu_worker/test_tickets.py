"""start_batch: the caller's one word on which requests of a batch start; the rest never run."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from kiln.gpu_worker.errors import JobStopped
from kiln.gpu_worker.protocol import GenerationRequest, GenerationResult
from kiln.gpu_worker.tickets import StopReason, Ticket, start_batch


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
    assert refused.stop_reason is StopReason.STOPPED
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
