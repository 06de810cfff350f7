"""Quarantine: a node whose device keeps failing different jobs stops taking work.

One job failing again and again says the job is bad (tasks/node/poison.py makes it poison); many
different jobs failing with device errors on one node say the device is. Once
`KILN_QUARANTINE_JOBS` different jobs have ended an attempt here with a device error within
`KILN_QUARANTINE_WINDOW_S`, the node is quarantined for the rest of its life: it stops consuming
its queues, hands back any delivery it is given, and its heartbeat says `quarantined` (`kiln admin
nodes` shows it). A restart, once the device is looked at, brings it back.

Device errors: the worker group died under the job (`WorkerGroupDied`, `RankStartupFailed`), or
the job failed with what the device or its driver raised (CUDA, cuDNN, cuBLAS, NCCL errors, a
device-side assert, an ECC error). Running out of memory is the job's size, not the device's
fault, and does not count.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

DEVICE_ERROR_TYPES = frozenset({"WorkerGroupDied", "RankStartupFailed"})
_DEVICE_MESSAGE = re.compile(
    r"CUDA error|CUDNN_STATUS|CUBLAS_STATUS|NCCL (?:error|WARN)|device-side assert|"
    r"uncorrectable ECC|Xid",
    re.IGNORECASE,
)


def is_device_error(error: Mapping[str, Any]) -> bool:
    """Whether a job's error says its device (or the group on it) failed."""
    if str(error.get("type")) in DEVICE_ERROR_TYPES:
        return True
    return bool(_DEVICE_MESSAGE.search(str(error.get("message", ""))))


class Quarantine:
    """Counts the different jobs device errors ended here lately; quarantines past the limit."""

    def __init__(
        self, jobs: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.jobs = jobs
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failed: dict[str, float] = {}  # job id -> when a device error last ended it here
        self.reason: str | None = None  # set once, for good: why the node is quarantined
        self.since: float | None = None  # wall-clock time it was (epoch s)

    def note(self, job_id: str, error: Mapping[str, Any]) -> bool:
        """Note how an attempt of `job_id` ended; True if the node is quarantined by it now."""
        if not is_device_error(error):
            return False
        now = self._clock()
        with self._lock:
            self._failed[job_id] = now
            self._failed = {j: t for j, t in self._failed.items() if now - t <= self.window_s}
            if self.reason is not None or len(self._failed) < self.jobs:
                return False
            self.reason = (
                f"{len(self._failed)} different jobs failed with device errors within "
                f"{self.window_s:g} s (last: {error.get('type')}: {error.get('message')})"
            )
            self.since = time.time()
        log.error("node quarantined: %s; it takes no more work", self.reason)
        return True

    def health(self) -> dict[str, Any] | None:
        """What the heartbeat says: `{reason, since}`, or None while the node is healthy."""
        return None if self.reason is None else {"reason": self.reason, "since": self.since}
