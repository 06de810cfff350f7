"""One GPU node's runtime: its coordinator, stores, the leases it holds, and its drain state.

`kiln worker` builds one `Node` in its main process before Celery consumes anything and registers
`run_job` bound to it (`tasks.node.jobs.register_run_job`); nothing process-wide names the node.
Its own loops live in `tasks.node.maintenance`; the cluster's, in `tasks.control`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.common.limits import DeclaredLimits
from kiln.common.request import InputSchema
from kiln.common.stops import StopReason
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.protocol import (
    GenerationRequest,
    GenerationResult,
    StepCheckpoint,
    StepProgress,
)
from kiln.gpu_worker.replicas import node_coordinator
from kiln.gpu_worker.sleep import node_asleep, node_warming
from kiln.gpu_worker.tickets import BatchStart, ShouldStop
from kiln.storage.errors import StorageError
from kiln.storage.job_store import JobRecord
from kiln.storage.leases import STOPS_READ
from kiln.storage.objects import ObjectStore
from kiln.storage.queues import DrainRequest
from kiln.storage.transitions import Start
from kiln.tasks.contract.inputs import InputViolation, first_input_violation
from kiln.tasks.contract.limits import LimitViolation, PipelineLimits, RequestShape
from kiln.tasks.node.adapters import AdapterSources
from kiln.tasks.node.held import HeldDeliveries
from kiln.tasks.node.metrics import GroupCollector, NodeMetrics
from kiln.tasks.node.progress_writer import ProgressWriter
from kiln.tasks.node.quarantine import Quarantine
from kiln.tasks.node.usage import NodeUsageReport
from kiln.tasks.node.waiting import WaitingInNode
from kiln.tasks.queue.process import ProcessParts
from kiln.tasks.queue.quotas import RunningCaps
from kiln.tasks.queue.submit import Publish, Submitter
from kiln.tasks.webhooks.event_sink import EventSink

log = logging.getLogger(__name__)


class GroupCoordinator(Protocol):
    """What a node uses of its worker group (`gpu_worker.coordinator.Coordinator`)."""

    def start(self) -> None:
        """Start the group's ranks and load their pipelines."""

    def shutdown(self) -> None:
        """Stop the group and its ranks."""

    def submit(
        self,
        request: GenerationRequest,
        on_progress: Callable[[StepProgress], None] | None = None,
        should_stop: ShouldStop | None = None,
        max_run_seconds: float | None = None,
        on_checkpoint: Callable[[StepCheckpoint], None] | None = None,
    ) -> Future[GenerationResult]:
        """Queue a request; the future holds its result or the reason it failed or stopped."""
        ...

    def set_batch_start(self, batch_start: BatchStart | None) -> None:
        """Ask `batch_start` which requests of each batch start (the others do not run)."""

    def pipeline_limits(self) -> Mapping[str, DeclaredLimits]:
        """What each loaded pipeline declares it can take, by pipeline name."""
        ...

    def pipeline_inputs(self) -> Mapping[str, InputSchema]:
        """The input schema of each loaded pipeline that declares one, by pipeline name."""
        ...

    def stats(self) -> dict[str, Any]:
        """The group's counters, for the node's heartbeat."""
        ...


@dataclass
class TrackedJob:
    """A job this node holds the lease of; the heartbeat renews it until untracked.

    Held first (still queued, waiting in the node: tasks/node/waiting.py), then started.
    """

    job_id: str
    lease_token: int
    # why the node takes it off its group at the next step (a cancel, a lost lease, a drain);
    # its `should_stop` hands the same reason to the coordinator
    stop_reason: StopReason | None = None
    last_progress_at: float = field(default_factory=time.time)
    last_stage: str = ""
    started: bool = False  # its group has started it (queued → running); until then it waits
    # its start is on its way to Redis (the batch's one round trip): the record may already say
    # running while `started` does not yet, so a drain in between must not take it for waiting
    starting: bool = False
    # its run takes step checkpoints (it has a plan): a stop checkpoints its step, so it may be
    # preempted (tasks/node/preempted.py); the heartbeat lists such jobs
    checkpoints: bool = False
    preempted_for: str | None = None  # the interactive job a preemption stops it for


class StartingJob(Protocol):
    """A held job handed to the group: how it starts when a batch takes it (tasks/node/attempt)."""

    def start_request(self) -> Start | None:
        """Its start, or None when it must not start (its start_by passed: expired now)."""
        ...

    def started(self, result: JobRecord | StorageError) -> bool:
        """What its start did: True when it runs (the record), False when it was refused."""
        ...


@dataclass
class ControlState:
    """The operator controls a node applies; tasks/node/controls.py keeps them current."""

    paused: frozenset[str] = frozenset()  # every paused queue, this node's or not
    drain: DrainRequest | None = None  # the operator's drain request for this node
    consuming: tuple[str, ...] = ()  # the job queues its Celery worker consumes now
    shutting_down: bool = False  # SIGTERM: the drain is for good, whatever the operator says

    def health(self, pipelines: Iterable[str]) -> dict[str, object]:
        """What the heartbeat says of them: paused queues of this node, drain, consumption."""
        served = set(pipelines)
        drain = self.drain
        return {
            "paused_queues": sorted(q for q in self.paused if q.partition(".")[2] in served),
            "drain": None if drain is None else {"exit": drain.exit, "since": drain.requested_at},
            "consuming": list(self.consuming),
        }


def default_node_id() -> str:
    """A node id unique per process: host name plus pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Node:
    """Everything a node's task threads and background loops share.

    `coordinator` defaults to gpu_worker's for `group` (replica groups of `group_size` ranks when
    that is smaller than the group: `gpu_worker.replicas`); `publish` (how `run_job` messages go
    out) to the Celery app's. Tests pass their own of either. Settings, stores and the Celery app
    are the process's `parts` (`this_process()` in `kiln worker`).
    """

    def __init__(
        self,
        group: GroupConfig,
        parts: ProcessParts,
        *,
        node_id: str | None = None,
        coordinator: GroupCoordinator | None = None,
        publish: Publish | None = None,
        group_size: int | None = None,
    ) -> None:
        self.node_id = node_id or default_node_id()
        self.group_config = group
        self.settings = settings = parts.settings
        self.storage_settings = parts.storage_settings
        self.store = parts.store
        self.objects: ObjectStore = parts.objects
        # LoRA adapters: the lora dir's and, with KILN_LORA_PREFIX, the store's (fetched on use)
        self.adapter_sources = AdapterSources.for_node(group.settings, self.objects)
        self.celery_app = parts.celery_app
        # (its publishes are re-publishes: a start given back, a busy lease, a preempted job)
        if publish is None:
            self.submitter = parts.submitter
        else:  # (a test's, to see what is published) its messages are still built as Celery's
            self.submitter = Submitter(self.store, settings, publish, messages=parts.messages)
        self.group_size = group_size or len(group.world())
        self.coordinator: GroupCoordinator = coordinator or node_coordinator(group, group_size)
        # every job event this node writes or announces goes through its one sink
        self.events = EventSink(self.store, self.celery_app, settings.webhook_progress_interval_s)
        self.progress = ProgressWriter(settings.progress_interval_s)
        self.waiting = WaitingInNode(self.node_id, self.progress, self.events)  # held, not started
        self.draining = threading.Event()
        # a device failing different jobs stops the node taking work (tasks/node/quarantine.py)
        self.quarantine = Quarantine(settings.quarantine_jobs, settings.quarantine_window_s)
        self.held = HeldDeliveries()  # job messages this worker holds, for its heartbeat
        self.usage = NodeUsageReport()  # its GPU-seconds held and busy, reported by the heartbeat
        # operator controls: pauses and this node's drain request (tasks/node/controls.py)
        self.controls = ControlState()
        self.running_caps = RunningCaps(parts.api_keys, settings.max_running_per_key)
        self._jobs: dict[str, TrackedJob] = {}
        self._starting: dict[str, StartingJob] = {}  # held jobs handed to the group, by id
        self._lock = threading.Lock()
        self.coordinator.set_batch_start(self.start_batch)
        self.started_at = time.time()
        scraped = GroupCollector(
            self.node_id,
            ",".join(group.devices),
            lambda: len(self.running_jobs()),
            self.coordinator,
        )
        # served by `kiln worker` (tasks/node/metrics.py)
        self.metrics = NodeMetrics(self.node_id, group.pipelines, scraped)
        self.events.add_listener(self.metrics.count_event)

    def start(self) -> None:
        """Spawn and warm up the group, start the progress writer; raises if the group cannot."""
        self.coordinator.start()
        self.progress.start()

    def shutdown(self) -> None:
        """Stop the group and the progress writer (idempotent)."""
        try:  # its last GPU-seconds held, so the usage buckets hold its whole warm time
            self.report_usage()
        except StorageError as exc:
            log.warning("node %s: its last usage report failed: %s", self.node_id, exc)
        self.coordinator.shutdown()
        self.progress.stop()

    @contextlib.contextmanager
    def tracking(self, job_id: str, lease_token: int) -> Iterator[TrackedJob]:
        """Hold a job on this node: its lease is renewed by the heartbeat while inside.

        A job tracked while the node drains is marked handed back from the start: the group
        stops it at once and it goes back to the queue. A job queued again by its attempt (a
        preemption pushes its message at the head of its queue) may be delivered again here
        before that attempt's delivery leaves: the newer delivery's tracking replaces it, and
        the older one's end leaves it in place (else its lease would go unrenewed).
        """
        tracked = TrackedJob(job_id, lease_token)
        if self.draining.is_set():
            tracked.stop_reason = StopReason.HANDED_BACK
        with self._lock:
            self._jobs[job_id] = tracked
        try:
            yield tracked
        finally:
            with self._lock:
                if self._jobs.get(job_id) is tracked:
                    del self._jobs[job_id]

    def tracked_jobs(self) -> list[TrackedJob]:
        """A snapshot of the jobs this node holds."""
        with self._lock:
            return list(self._jobs.values())

    def running_jobs(self) -> list[TrackedJob]:
        """The jobs this node holds that its group has started."""
        return [tracked for tracked in self.tracked_jobs() if tracked.started]

    def hand_back_all(self) -> None:
        """Ask every running job to stop at its next step and go back to the queue."""
        self.draining.set()
        for tracked in self.tracked_jobs():
            if tracked.stop_reason is None:
                tracked.stop_reason = StopReason.HANDED_BACK

    def holds_back(self, queue: str) -> str | None:
        """Why a delivery from `queue` must not start here now (quarantine, drain, pause)."""
        if self.quarantine.reason is not None:
            return "the node is quarantined"
        if self.controls.drain is not None:
            return "the node is draining"
        if queue in self.controls.paused:
            return f"queue {queue} is paused"
        return None

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

    def pipeline_inputs(self) -> dict[str, InputSchema]:
        """Per served pipeline that declares one, its input schema as its ranks loaded it."""
        declared = self.coordinator.pipeline_inputs()
        return {
            name: dict(declared[name]) for name in self.group_config.pipelines if name in declared
        }

    def bad_inputs(self, pipeline: str, inputs: Mapping[str, Any]) -> InputViolation | None:
        """Why this node's `pipeline` does not take these extra inputs; None when it does."""
        schema = self.pipeline_inputs().get(pipeline)
        return first_input_violation(pipeline, [schema] if schema else [], inputs)

    def submit(
        self,
        request: GenerationRequest,
        on_progress: Callable[[StepProgress], None] | None = None,
        should_stop: ShouldStop | None = None,
        max_run_seconds: float | None = None,
        on_checkpoint: Callable[[StepCheckpoint], None] | None = None,
    ) -> Future[GenerationResult]:
        """Hand a request to the node's group (with replica groups: the least busy one)."""
        return self.coordinator.submit(
            request, on_progress, should_stop, max_run_seconds, on_checkpoint
        )

    def report_usage(self) -> None:
        """Add its GPU-seconds held and busy since the last report to the usage buckets."""
        self.usage.report(self.store, self.node_id, self.coordinator)

    def take_charge(self, request_id: str) -> tuple[float, float | None]:
        """A finished request's GPU-seconds and joules (kiln/common/ledger.py).

        A test's fake group, like its missing `counters`, charges nothing.
        """
        take = getattr(self.coordinator, "take_charge", None)
        return take(request_id) if take is not None else (0.0, None)

    @contextlib.contextmanager
    def starting(self, job_id: str, job: StartingJob) -> Iterator[None]:
        """While inside, the group's batch that takes `job_id` starts it through `job`."""
        with self._lock:
            self._starting[job_id] = job
        try:
            yield
        finally:
            with self._lock:
                self._starting.pop(job_id, None)

    def start_batch(self, job_ids: Sequence[str]) -> set[str]:
        """The jobs of a batch the group takes that start now: one round trip for all of them.

        Called by the coordinator (its dispatcher thread) as the batch leaves for the ranks. Each
        held job is moved to running, fenced by its lease (`StartingJob`); a refused one does
        not run. A request no job of this node waits for (none in tests) starts as it is.
        """
        with self._lock:
            jobs = {job_id: self._starting.get(job_id) for job_id in job_ids}
        allowed = {job_id for job_id, job in jobs.items() if job is None}
        asked: list[tuple[StartingJob, Start]] = []
        for job in jobs.values():
            if job is None:
                continue
            try:
                start = job.start_request()
            except StorageError as exc:  # its cap unread: this one is refused, not the batch
                job.started(exc)
                continue
            if start is not None:
                asked.append((job, start))
        if not asked:
            return allowed
        try:
            results = self.store.start_many([start for _, start in asked])
        except StorageError as exc:  # none started: each goes back as its attempt decides
            log.warning("starting %d job(s) failed: %s", len(asked), exc)
            results = [exc] * len(asked)
        for (job, start), result in zip(asked, results, strict=True):
            if job.started(result):
                allowed.add(start.job_id)
        return allowed

    def adapters(self, stats: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
        """Per served pipeline, its LoRA adapters: available, loaded, fused (from `stats`)."""
        return self.adapter_sources.heartbeat(self.group_config.pipelines, stats)

    def health(self) -> dict[str, object]:
        """What the heartbeat publishes about this node."""
        jobs = self.running_jobs()
        stats = self.coordinator.stats()
        return {
            "node_id": self.node_id,
            "pipelines": sorted(self.group_config.pipelines),
            "limits": {name: limits.to_dict() for name, limits in self.pipeline_limits().items()},
            "inputs": self.pipeline_inputs(),
            "adapters": self.adapters(stats),
            "devices": list(self.group_config.devices),
            "group_size": self.group_size,
            "max_batch": self.group_config.max_batch,  # sizes the batch windows (batches/fairness)
            "jobs_running": len(jobs),
            "jobs_waiting": len(self.waiting),  # held, queued until the group starts them
            # running jobs a priority preemption may suspend (tasks/control/preemption.py)
            "checkpointing_jobs": sorted(j.job_id for j in jobs if j.checkpoints),
            # the stop requests its cancel watch reads: a node of an earlier release lists none
            # and takes a preemption's request for a cancel, so it is asked no preemption
            "stops_read": [str(reason) for reason in STOPS_READ],
            "last_progress_at": max((j.last_progress_at for j in jobs), default=None),
            "draining": self.draining.is_set(),
            "quarantined": self.quarantine.health(),  # None, or {reason, since}
            # Sleep and warm-up (gpu_worker/sleep.py): idle memory released; (re)starting groups.
            "asleep": node_asleep(stats),
            "warming": node_warming(stats),
            **self.controls.health(self.group_config.pipelines),
            "started_at": self.started_at,
            "coordinator": stats,
        }
