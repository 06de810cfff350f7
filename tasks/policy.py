"""Small named policies of a job run: retry backoff and the error shape of a failure."""

from __future__ import annotations

import random
from typing import Any

from tasks.settings import KilnSettings


def retry_delay(attempt: int, settings: KilnSettings) -> float:
    """Exponential backoff with full jitter's upper half: between d/2 and d for attempt n."""
    ceiling = min(settings.retry_backoff_s * 2 ** max(attempt - 1, 0), settings.retry_backoff_max_s)
    return random.uniform(ceiling / 2, ceiling)


def error_dict(exc: BaseException) -> dict[str, Any]:
    """The job view's `error` for an exception: its type, message and whether a retry may help."""
    return {
        "type": type(exc).__name__,
        "message": str(exc) or type(exc).__name__,
        "retryable": bool(getattr(exc, "retryable", False)),
    }
