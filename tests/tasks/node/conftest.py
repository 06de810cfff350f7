"""What `JobRunner` needs, without ranks.

A node on real Redis and a real local object store, with a fake worker group and a recording
publish.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kiln.common.limits import DeclaredLimits
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.errors import JobStopped
from kiln.gpu_worker.protocol import (
    GenerationRequest,
    GenerationResult,
    StepCheckpoint,
    StepProgress,
)
from kiln.gpu_worker.tickets import BatchStart, ShouldStop
from kiln.storage.job_store import JobEvent, JobStore, NewJob
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.node.jobs import JobRunner
from kiln.tasks.node.node import Node
from kiln.tasks.queue.process import ProcessParts
from tests.storage.helpers import new_job
from tests.waiting import wait_until

PIPELINE = "tiny"
QUEUE = f"interactive.{PIPELINE}"
STEPS = 4


class FakeCoordinator:
    """Stands in for gpu_worker's Coordinator.

    It has what `JobRunner` calls on it (`submit`, and `pipeline_limits` through the node), plus
    the node's no-op lifecycle.

    `submit` runs the request at once on the caller's thread, step by step like the group: it
    reports progress, calls `on_step(step)` (the test's hook), then honours `should_stop` by
    raising JobStopped. `fail_with` is raised instead of returning outputs.
    """

    def __init__(self, limits: Mapping[str, DeclaredLimits] | None = None) -> None:
        self.limits = dict(limits or {})
        self.inputs: dict[str, dict[str, Any]] = {}  # input schemas the fake's pipelines declare
        self.requests: list[GenerationRequest] = []
        self.on_step: Callable[[int], None] = lambda _step: None
        self.fail_with: BaseException | None = None
        self.batch_start: BatchStart | None = None

    def set_batch_start(self, batch_start: BatchStart | None) -> None:
        self.batch_start = batch_start

    def submit(
        self,
        request: GenerationRequest,
        on_progress: Callable[[StepProgress], None] | None = None,
        should_stop: ShouldStop | None = None,
        max_run_seconds: float | None = None,
        on_checkpoint: Callable[[StepCheckpoint], None] | None = None,
    ) -> Future[GenerationResult]:
        del max_run_seconds  # the fake runs at once; no deadline can pass
        del on_checkpoint  # the fake takes no step checkpoints
        future: Future[GenerationResult] = Future()
        # as the real one as a batch of one takes it: stopped, or refused its start, it never runs
        if should_stop is not None and should_stop():
            future.set_exception(JobStopped(f"request {request.request_id} stopped while queued"))
            return future
        if self.batch_start is not None and request.request_id not in self.batch_start(
            [request.request_id]
        ):
            future.set_exception(JobStopped(f"request {request.request_id} was refused its start"))
            return future
        self.requests.append(request)
        try:
            future.set_result(self._run(request, on_progress, should_stop))
        except BaseException as exc:  # the real coordinator hands every failure to the future
            future.set_exception(exc)
        return future

    def _run(
        self,
        request: GenerationRequest,
        on_progress: Callable[[StepProgress], None] | None,
        should_stop: ShouldStop | None,
    ) -> GenerationResult:
        for step in range(1, request.steps + 1):
            if on_progress is not None:
                on_progress(StepProgress("denoising", step, request.steps))
            self.on_step(step)
            if should_stop is not None and should_stop():
                raise JobStopped(f"request {request.request_id} stopped")
        if self.fail_with is not None:
            raise self.fail_with
        frames = np.full((request.num_frames, request.height, request.width, 3), 128, np.uint8)
        return GenerationResult(request.request_id, [frames] * request.num_outputs)

    def pipeline_limits(self) -> dict[str, DeclaredLimits]:
        return dict(self.limits)

    def pipeline_inputs(self) -> dict[str, dict[str, Any]]:
        return dict(self.inputs)

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {}


@dataclass
class NodeHarness:
    """A node whose group is a FakeCoordinator and whose `run_job` publishes are recorded."""

    node: Node
    coordinator: FakeCoordinator
    store: JobStore  # the test's own connection, as another process would see the job
    published: list[tuple[str, str, float]] = field(default_factory=list)

    def submit(self, **fields: Any) -> str:
        """Create a queued job straight in the store (its effective request, seed included)."""
        request = JobRequest(
            **{"pipeline": PIPELINE, "prompt": "a kiln", "width": 64, "height": 64,
               "steps": STEPS, "seed": 7, **fields}
        )  # fmt: skip
        job_id = uuid.uuid4().hex
        self.store.create_job(NewJob(id=job_id, request=request.to_record()))
        return job_id

    def running(self, count: int, queue: str) -> list[tuple[str, int]]:
        """`count` jobs of `queue` started under leases this node's deliveries hold: (id, token)."""
        started = []
        for _ in range(count):
            record, _ = self.store.create_job(new_job(lane=queue.split(".")[0], queue=queue))
            token = self.store.acquire_lease(record.id, f"{self.node.node_id}/delivery-{record.id}")
            self.store.start(record.id, token)
            started.append((record.id, token))
        return started

    def deliver(self, job_id: str) -> None:
        """One delivery of `run_job(job_id)` on this node."""
        JobRunner(self.node, job_id).run()

    def event_types(self, job_id: str) -> list[str]:
        """The job's event types, oldest first."""
        return [event.type for event in self.events(job_id)]

    def events(self, job_id: str) -> list[JobEvent]:
        """The job's events, oldest first."""
        return self.store.events(job_id)


NodeFactory = Callable[..., NodeHarness]


def node_settings(**overrides: Any) -> KilnSettings:
    """Node settings for these tests: a backoff whose jitter range is easy to assert."""
    values: dict[str, Any] = {"retry_backoff_s": 2.0, "retry_backoff_max_s": 60.0}
    return KilnSettings(**{**values, **overrides})


@pytest.fixture
def make_node(storage_settings: StorageSettings, job_store: JobStore) -> Iterator[NodeFactory]:
    """Nodes on the test namespace: `make_node(limits=..., storage=..., **settings overrides)`."""
    made: list[Node] = []

    def make(
        limits: Mapping[str, DeclaredLimits] | None = None,
        storage: StorageSettings | None = None,
        **overrides: Any,
    ) -> NodeHarness:
        """`storage`: the node's own (say, its Redis through a proxy), else the test's."""
        settings = node_settings(**overrides)
        coordinator = FakeCoordinator(limits)
        published: list[tuple[str, str, float]] = []

        def publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
            published.append((job_id, queue, countdown))

        node = Node(
            GroupConfig(devices=["cpu:1"], pipelines={PIPELINE: PIPELINE}),
            ProcessParts(settings, storage or storage_settings),
            node_id="node-under-test",
            coordinator=coordinator,
            publish=publish,
        )
        made.append(node)
        return NodeHarness(node, coordinator, job_store, published)

    yield make
    for node in made:
        node.celery_app.close()
        node.store.redis.close()


@pytest.fixture
def harness(make_node: NodeFactory) -> NodeHarness:
    """A node with default test settings and no declared limits."""
    return make_node()


def wait_until_expired(store: JobStore, job_id: str, timeout_s: float = 10.0) -> None:
    """Block until the job's lease has lapsed (by the Redis clock)."""
    wait_until(
        lambda: store.lease_owner(job_id),
        lambda owner: owner is None,
        timeout_s=timeout_s,
        poll_s=0.01,
        what=f"the lease of {job_id} lapsed",
    )
