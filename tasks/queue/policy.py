"""Small named policies of a job run: retry backoff and the error shape of a failure."""

from __future__ import annotations

from typing import Any

from kiln.tasks.contract.backoff import doubling_delay, equal_jitter
from kiln.tasks.contract.settings import KilnSettings


def retry_delay(attempt: int, settings: KilnSettings) -> float:
    """Delay before re-publishing a job after failed attempt n: from [d/2, d] (docs §5).

    d = min(KILN_RETRY_BACKOFF_S · 2^(n-1), KILN_RETRY_BACKOFF_MAX_S).
    """
    ceiling = doubling_delay(attempt, settings.retry_backoff_s, settings.retry_backoff_max_s)
    return equal_jitter(ceiling)


def error_dict(exc: BaseException) -> dict[str, Any]:
    """The job view's `error` for an exception: its type, message and whether a retry may help."""
    return {
        "type": type(exc).__name__,
        "message": str(exc) or type(exc).__name__,
        "retryable": bool(getattr(exc, "retryable", False)),
    }
