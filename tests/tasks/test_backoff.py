"""Retry and poll delays (contract.backoff): the doubling curve and the webhook schedule."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.backoff import doubling_delay, equal_jitter, scheduled_delay
from kiln.tasks.contract.schemas import JobRequest

# --- the doubling curve -----------------------------------------------------------------------


def test_doubling_delay_doubles_from_the_first_and_stops_at_the_cap() -> None:
    assert [doubling_delay(n, 2.0, 10.0) for n in range(1, 6)] == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert doubling_delay(0, 2.0, 10.0) == 2.0  # no attempt yet: the first delay


def test_doubling_delay_survives_any_number_of_attempts() -> None:
    # a client that polls for hours counts thousands of polls: 2 ** n must not overflow a float
    assert doubling_delay(100_000, 0.05, 1.0) == 1.0
    assert doubling_delay(100_000, 1e300, 60.0) == 60.0


def test_equal_jitter_stays_in_the_upper_half() -> None:
    rng = random.Random(5)
    samples = [equal_jitter(8.0, rng) for _ in range(200)]
    assert all(4.0 <= s <= 8.0 for s in samples)
    assert len(set(samples)) > 100


def test_client_wait_polls_on_the_doubling_curve(monkeypatch: pytest.MonkeyPatch) -> None:
    statuses = iter(["queued"] * 6 + ["succeeded"])

    def answer(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=job_body(next(statuses)))

    slept: list[float] = []
    monkeypatch.setattr("kiln.tasks.client.client.time.sleep", slept.append)
    client = KilnClient("http://kiln.test", transport=httpx.MockTransport(answer))
    assert client.wait("j1", timeout=60, poll_s=0.5).status == "succeeded"
    assert slept == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]


def job_body(status: str) -> dict[str, Any]:
    parameters = JobRequest(prompt="p").to_record()
    return {
        "id": "j1",
        "status": status,
        "lane": "interactive",
        "created_at": 1.0,
        "attempts": 0,
        "parameters": parameters,
    }


# --- the webhook schedule: not a doubling, the operator's own list ------------------------------


def test_scheduled_delay_follows_the_schedule_then_stops() -> None:
    rng = random.Random(1)
    delays = [
        scheduled_delay(n, [10, 60, 300], jitter=0.0, rng=rng, retry_after_max=3600)
        for n in (1, 2, 3, 4)
    ]
    assert delays == [10.0, 60.0, 300.0, None]


def test_jitter_only_shortens_within_its_fraction() -> None:
    rng = random.Random(7)
    samples = [
        scheduled_delay(2, [10, 100], jitter=0.2, rng=rng, retry_after_max=3600) for _ in range(200)
    ]
    assert all(s is not None and 80.0 <= s <= 100.0 for s in samples)
    assert len({round(s or 0, 3) for s in samples}) > 100  # spread out, not one value


def test_retry_after_is_a_lower_bound_with_a_cap() -> None:
    def delay(attempt: int, retry_after: float, cap: float = 21600.0) -> float | None:
        return scheduled_delay(
            attempt,
            [10],
            jitter=0.0,
            rng=random.Random(3),
            retry_after=retry_after,
            retry_after_max=cap,
        )

    assert delay(1, 120) == 120.0
    assert delay(1, 2) == 10.0
    assert delay(1, 10**9, cap=3600) == 3600.0
    assert delay(2, 5) is None  # the schedule still ends
