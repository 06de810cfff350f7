"""Quarantine: a node whose device keeps failing different jobs stops taking work.

One job failing again and again says the job is bad (tasks/node/poison.py makes it poison); many
different jobs failing with device errors on one node say the device is. Once
`KILN_QUARANTINE_JOBS` separate device failures (the jobs one group death fails together count as
one) have failed as many different jobs within `KILN_QUARANTINE_WINDOW_S`, the node is
quarantined for the rest of its life: it stops consuming its queues, hands back any delivery it
is given, and its heartbeat says `quarantined` (`kiln admin nodes` shows it). A restart, once the
device is looked at, brings it back.

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


# failures this close together are one incident: a group's death fails every job of its batch
# at once, and that is one failure of the device, not several
INCIDENT_S = 10.0


class Quarantine:
    """Counts the device failures of different jobs here lately; quarantines past the limit.

    A failure within `INCIDENT_S` of the first of the current incident joins it (the jobs a group
    death failed together); the node is quarantined once `jobs` incidents within `window_s`
    failed at least `jobs` different jobs between them.
    """

    def __init__(
        self, jobs: int, window_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.jobs = jobs
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._incidents: list[tuple[float, set[str]]] = []  # (first failure, jobs it failed)
        self.reason: str | None = None  # set once, for good: why the node is quarantined
        self.since: float | None = None  # wall-clock time it was (epoch s)

    def note(self, job_id: str, error: Mapping[str, Any]) -> bool:
        """Note how an attempt of `job_id` ended; True if the node is quarantined by it now."""
        if not is_device_error(error):
            return False
        now = self._clock()
        with self._lock:
            incidents = [(t, jobs) for t, jobs in self._incidents if now - t <= self.window_s]
            if incidents and now - incidents[-1][0] <= INCIDENT_S:
                incidents[-1][1].add(job_id)
            else:
                incidents.append((now, {job_id}))
            self._incidents = incidents
            different = set().union(*(jobs for _, jobs in incidents))
            if self.reason is not None or min(len(incidents), len(different)) < self.jobs:
                return False
            self.reason = (
                f"{len(incidents)} device failures of {len(different)} different jobs within "
                f"{self.window_s:g} s (last: {error.get('type')}: {error.get('message')})"
            )
            self.since = time.time()
        log.error("node quarantined: %s; it takes no more work", self.reason)
        return True

    def health(self) -> dict[str, Any] | None:
        """What the heartbeat says: `{reason, since}`, or None while the node is healthy."""
        return None if self.reason is None else {"reason": self.reason, "since": self.since}
