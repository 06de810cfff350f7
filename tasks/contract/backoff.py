"""How long to wait before trying again. Two rules, kept apart because they differ.

`doubling_delay`: `first_s · 2^(n-1)`, capped. Job retries (docs/contract.md §5) draw their delay
from [d/2, d] of it (`equal_jitter`, in `queue.policy`); the client's `wait` polls at this pace.

`scheduled_delay`: webhook retries (docs/contract.md §7) do not double. They follow the operator's
fixed schedule, each delay shortened by up to a jitter fraction, and a receiver's Retry-After is a
floor under it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

# 2.0 ** 1024 overflows a float; by 2 ** 1000 every real cap has long been reached
_MAX_DOUBLINGS = 1000


def doubling_delay(attempt: int, first_s: float, cap_s: float) -> float:
    """`first_s` before attempt 1, doubled for each later attempt, never above `cap_s`."""
    doublings = min(max(attempt - 1, 0), _MAX_DOUBLINGS)
    return min(first_s * 2.0**doublings, cap_s)


def equal_jitter(ceiling: float, rng: random.Random | None = None) -> float:
    """A delay drawn from [ceiling/2, ceiling]: retries spread out, none comes too soon."""
    uniform = rng.uniform if rng is not None else random.uniform
    return uniform(ceiling / 2, ceiling)


def scheduled_delay(
    attempt: int,
    schedule: Sequence[float],
    *,
    jitter: float,
    rng: random.Random,
    retry_after: float | None = None,
    retry_after_max: float,
) -> float | None:
    """Seconds before the attempt after `attempt` (1-based), or None when it was the last.

    The schedule's delay is shortened by up to `jitter` of itself so retries of many jobs spread
    out; a receiver's Retry-After is a lower bound (capped at `retry_after_max`).
    """
    if attempt > len(schedule):
        return None
    delay = float(schedule[attempt - 1]) * (1.0 - jitter * rng.random())
    if retry_after is not None:
        delay = max(delay, min(retry_after, retry_after_max))
    return max(delay, 0.0)
