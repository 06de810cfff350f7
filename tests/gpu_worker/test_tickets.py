"""Ticket.begin_running: the caller's `on_start` is the last word before a request runs."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import pytest

from kiln.gpu_worker.errors import JobStopped
from kiln.gpu_worker.protocol import GenerationRequest, GenerationResult
from kiln.gpu_worker.tickets import StopReason, Ticket


def recorder(seen: list[str], name: str) -> Callable[[], bool]:
    """An on_start that notes it was asked and accepts."""

    def on_start() -> bool:
        seen.append(name)
        return True

    return on_start


def ticket(**callbacks: object) -> Ticket:
    request = GenerationRequest(
        "r1", "tiny", "a kiln", width=64, height=64, steps=2, seed=1, guidance_scale=0.0
    )
    future: Future[GenerationResult] = Future()
    return Ticket(request, future, 0.0, **callbacks)  # type: ignore[arg-type]


def test_a_start_the_caller_accepts_runs() -> None:
    started: list[str] = []
    t = ticket(on_start=recorder(started, "now"))
    assert t.begin_running()
    assert started == ["now"]
    assert t.future.running()


@pytest.mark.parametrize("refusal", ["answers no", "raises"])
def test_a_refused_start_never_runs(refusal: str) -> None:
    def on_start() -> bool:
        if refusal == "raises":
            raise RuntimeError("Redis unreachable")
        return False

    t = ticket(on_start=on_start)
    assert not t.begin_running()
    assert t.stop_reason is StopReason.STOPPED
    with pytest.raises(JobStopped, match="refused its start"):
        t.future.result(timeout=0)


def test_a_stop_or_a_cancelled_future_is_never_started() -> None:
    started: list[str] = []
    stopped = ticket(should_stop=lambda: True, on_start=recorder(started, "x"))
    assert not stopped.begin_running()
    cancelled = ticket(on_start=recorder(started, "y"))
    cancelled.future.cancel()
    assert not cancelled.begin_running()
    assert started == []  # neither was started (no record moved to running for them)
