"""One GPU node's runtime: its coordinator, stores, leases it holds, and its drain state.

The node worker's main process builds one `Node` before Celery starts consuming; task threads
reach it through `current_node()`. Background loops (heartbeat, reaper, sweeper) live in
`tasks.maintenance`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from celery import Celery

from gpu_worker.config import GroupConfig
from gpu_worker.coordinator import Coordinator
from storage.objects import ObjectStore, open_object_store
from storage.settings import StorageSettings
from storage.status import JobStore
from tasks.limits import LimitViolation, PipelineLimits, RequestShape
from tasks.progress_writer import ProgressWriter
from tasks.settings import KilnSettings
from tasks.submit import Submitter, celery_publisher

log = logging.getLogger(__name__)


class StopReason:
    """Why a running job is asked to stop at its next step."""

    CANCELED = "canceled"
    LEASE_LOST = "lease_lost"
    HANDED_BACK = "handed_back"


@dataclass
class TrackedJob:
    """A job this node holds the lease of; the heartbeat renews it until untracked."""

    job_id: str
    lease_token: int
    stop_reason: str | None = None
    last_progress_at: float = field(default_factory=time.time)
    last_stage: str = ""


def default_node_id() -> str:
    """A node id unique per process: host name plus pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Node:
    """Everything a node's task threads share."""

    def __init__(
        self,
        group: GroupConfig,
        settings: KilnSettings,
        storage_settings: StorageSettings,
        *,
        celery_app: Celery,
        node_id: str | None = None,
    ) -> None:
        self.node_id = node_id or default_node_id()
        self.group_config = group
        self.settings = settings
        self.storage_settings = storage_settings
        self.store = JobStore.from_settings(storage_settings)
        self.objects: ObjectStore = open_object_store(storage_settings)
        self.celery_app = celery_app
        self.submitter = Submitter(self.store, settings, celery_publisher(celery_app))
        self.coordinator = Coordinator(group)
        self.progress = ProgressWriter(self.store, settings.progress_interval_s)
        self.draining = threading.Event()
        self._jobs: dict[str, TrackedJob] = {}
        self._lock = threading.Lock()
        self.started_at = time.time()

    def start(self) -> None:
        """Spawn and warm up the group; raises if it cannot start."""
        self.coordinator.start()
        self.progress.start()

    def shutdown(self) -> None:
        """Stop the group and the progress writer (idempotent)."""
        self.coordinator.shutdown()
        self.progress.stop()

    @contextlib.contextmanager
    def tracking(self, job_id: str, lease_token: int) -> Iterator[TrackedJob]:
        """Hold a job on this node: its lease is renewed by the heartbeat while inside."""
        tracked = TrackedJob(job_id, lease_token)
        if self.draining.is_set():
            tracked.stop_reason = StopReason.HANDED_BACK
        with self._lock:
            self._jobs[job_id] = tracked
        try:
            yield tracked
        finally:
            with self._lock:
                self._jobs.pop(job_id, None)

    def tracked_jobs(self) -> list[TrackedJob]:
        """A snapshot of the jobs this node holds."""
        with self._lock:
            return list(self._jobs.values())

    def hand_back_all(self) -> None:
        """Ask every running job to stop at its next step and go back to the queue."""
        self.draining.set()
        for tracked in self.tracked_jobs():
            if tracked.stop_reason is None:
                tracked.stop_reason = StopReason.HANDED_BACK

    def pipeline_limits(self) -> dict[str, PipelineLimits]:
        """Per served pipeline, the limits its ranks declared (schema ranges where none)."""
        declared = self.coordinator.pipeline_limits()
        return {
            name: PipelineLimits.from_dict(declared.get(name, {}))
            for name in self.group_config.pipelines
        }

    def over_limits(self, pipeline: str, request: RequestShape) -> LimitViolation | None:
        """Why this node's `pipeline` does not take `request`; None when it does."""
        limits = self.pipeline_limits().get(pipeline)
        return limits.violation(pipeline, request) if limits is not None else None

    def health(self) -> dict[str, object]:
        """What the heartbeat publishes about this node."""
        jobs = self.tracked_jobs()
        return {
            "node_id": self.node_id,
            "pipelines": sorted(self.group_config.pipelines),
            "limits": {name: limits.to_dict() for name, limits in self.pipeline_limits().items()},
            "devices": list(self.group_config.devices),
            "jobs_running": len(jobs),
            "last_progress_at": max((j.last_progress_at for j in jobs), default=None),
            "draining": self.draining.is_set(),
            "started_at": self.started_at,
            "coordinator": self.coordinator.stats(),
        }


_current: Node | None = None


def set_current_node(node: Node | None) -> None:
    """Install the node the task threads of this process use."""
    global _current
    _current = node


def current_node() -> Node:
    """The node of this worker process; run_job needs one."""
    if _current is None:
        raise RuntimeError("run_job needs a node: start it with `kiln worker --pipeline ...`")
    return _current
