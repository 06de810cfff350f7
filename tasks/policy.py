"""Small named policies of a job run: retry backoff, progress throttling, cancel polling."""

from __future__ import annotations

import random
import time
from typing import Any

from storage.status import JobStore
from tasks.settings import KilnSettings

CANCEL_POLL_S = 0.02  # a GET per step is cheap; cancel must land within a step


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


class ProgressThrottle:
    """Lets a progress write through at most every `interval_s`, and always on a stage change
    or the last step of a stage."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_at = 0.0
        self._last_stage = ""

    def due(self, stage: str, last_step: bool) -> bool:
        """Whether this progress update should be written."""
        now = time.monotonic()
        if stage != self._last_stage or last_step or now - self._last_at >= self.interval_s:
            self._last_at = now
            self._last_stage = stage
            return True
        return False


class CancelCheck:
    """Reads a job's cancel flag at most every `CANCEL_POLL_S`; once set it stays set."""

    def __init__(self, store: JobStore, job_id: str, poll_s: float = CANCEL_POLL_S) -> None:
        self.store = store
        self.job_id = job_id
        self.poll_s = poll_s
        self._checked_at = 0.0
        self._canceled = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self._canceled and now - self._checked_at >= self.poll_s:
            self._checked_at = now
            self._canceled = self.store.cancel_requested(self.job_id)
        return self._canceled
