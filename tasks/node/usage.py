"""A node's own GPU-seconds, held warm and busy, added to the hourly usage buckets by its heartbeat.

Each report adds what the group's counters grew by since the report before (gpu_worker/counters.py:
`held_gpu_s` = devices × time since its group was first ready, `busy_gpu_s` = the batches'
seconds × devices, which its jobs were charged), so a range's idle GPU-seconds are held - busy
and the jobs' GPU-seconds plus the nodes' idle add up to the nodes' held (storage/usage.py).
"""

from __future__ import annotations

import threading
from typing import Any

from kiln.gpu_worker.counters import GroupCounters
from kiln.storage.base import StoreBase
from kiln.storage.usage import add_node_usage


class NodeUsageReport:
    """What a node has reported so far; `report` adds the growth since."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the heartbeat's thread, and the node's last report
        self._held = 0.0
        self._busy = 0.0

    def report(self, store: StoreBase, node_id: str, coordinator: Any) -> None:
        """Add the counters' growth since the last report (a fake group without counters: none)."""
        read = getattr(coordinator, "counters", None)
        counters = read() if read is not None else None
        if not isinstance(counters, GroupCounters):
            return
        with self._lock:
            held = counters.held_gpu_s - self._held
            busy = counters.busy_gpu_s - self._busy
            add_node_usage(store, node_id, held, busy)
            self._held, self._busy = counters.held_gpu_s, counters.busy_gpu_s
