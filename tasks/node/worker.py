"""`kiln worker`: a Celery worker (threads pool) whose main process owns one node.

The node (coordinator + GPU group) starts and warms up before the worker consumes anything, and
stops after the worker has finished. SIGTERM: Celery stops consuming and waits for the running
tasks; after `drain_grace_s` Kiln hands the ones still running back to the queue, so the
worker exits within the grace and no job is lost.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery
from celery.signals import worker_shutting_down

from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import make_celery_app
from kiln.tasks.queue.lanes import LANES, WEBHOOKS_QUEUE, node_queues

if TYPE_CHECKING:  # the node's modules load torch; a webhooks-only worker never imports them
    from kiln.tasks.node.maintenance import Maintenance
    from kiln.tasks.node.node import Node

log = logging.getLogger(__name__)

WEBHOOKS_ONLY_NOTICE = (
    "kiln worker: no --pipeline given, so this worker serves no pipeline and only delivers "
    f"webhooks (queue {WEBHOOKS_QUEUE!r})"
)


@dataclass(frozen=True)
class WorkerOptions:
    """What `kiln worker` was asked to run."""

    pipelines: dict[str, str] = field(default_factory=dict)
    devices: str = "cpu:1"
    lanes: tuple[str, ...] = LANES
    max_batch: int = 4
    batch_window_ms: float = 0.0
    parallel: str = "auto"
    concurrency: int | None = None
    webhooks: bool = False
    node_id: str | None = None
    loglevel: str = "INFO"

    def __post_init__(self) -> None:
        if self.pipelines:  # a webhooks-only worker has no group, and must not import torch
            check_group_options(self.devices, self.parallel)


def check_group_options(devices: str, parallel: str) -> None:
    """Refuse, naming the flag, devices this machine lacks and a parallel mode that wastes them.

    Raised while the options are built, before Celery or any rank starts (ValueError: the CLI
    prints it as one line).
    """
    from kiln.gpu_worker.config import check_devices, check_parallel
    from kiln.gpu_worker.parallel import ParallelSpec

    try:
        world = check_devices(split_devices(devices))
    except ValueError as exc:
        raise ValueError(f"--devices {devices}: {exc}") from exc
    try:
        check_parallel(ParallelSpec(mode=parallel), len(world))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"--parallel {parallel}: {exc}") from exc


def split_devices(devices: str) -> list[str]:
    """`cuda:0, cuda:1` → ['cuda:0', 'cuda:1']."""
    return [device.strip() for device in devices.split(",")]


def parse_pipelines(values: Sequence[str]) -> dict[str, str]:
    """`tiny` → {tiny: tiny}; `default=tiny` → {default: tiny}; `x=diffusers:/m` likewise."""
    pipelines: dict[str, str] = {}
    for value in values:
        name, sep, spec = value.partition("=")
        if not sep:
            spec = name
            name = name.split(":", 1)[0] if name.startswith(("diffusers:", "python:")) else name
        if not name or not spec:
            raise ValueError(f"--pipeline {value!r}: expected NAME or NAME=SPEC")
        pipelines[name] = spec
    return pipelines


def parse_lanes(value: str) -> tuple[str, ...]:
    """`interactive,bulk` → lanes, refusing unknown names."""
    lanes = tuple(part.strip() for part in value.split(",") if part.strip())
    unknown = [lane for lane in lanes if lane not in LANES]
    if unknown or not lanes:
        raise ValueError(f"--queues: unknown lane(s) {unknown}; use {', '.join(LANES)}")
    return lanes


def worker_queues(options: WorkerOptions) -> list[str]:
    """The queues this worker consumes, in priority order."""
    queues = node_queues(options.lanes, list(options.pipelines))
    if options.webhooks or not options.pipelines:
        queues.append(WEBHOOKS_QUEUE)
    return queues


def run_worker(options: WorkerOptions) -> None:
    """Start the node (if it serves pipelines), then the Celery worker; stop both at the end."""
    settings, storage_settings = KilnSettings(), StorageSettings()
    app = make_celery_app(settings, storage_settings)
    if not options.pipelines:
        # Printed, not logged: Celery sets logging up only later, inside `worker_main`.
        print(WEBHOOKS_ONLY_NOTICE, file=sys.stderr, flush=True)
    node, maintenance = _start_node(app, options, settings, storage_settings)
    concurrency = options.concurrency or (2 * options.max_batch if node else 8)
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={concurrency}",
        f"--queues={','.join(worker_queues(options))}",
        f"--hostname={(node.node_id if node else 'webhooks')}@%h",
        f"--loglevel={options.loglevel}",
        "--without-gossip",
        "--without-mingle",
    ]
    try:
        app.worker_main(argv)
    finally:
        if maintenance is not None:
            maintenance.stop()
        if node is not None:
            node.shutdown()


def _start_node(
    app: Celery, options: WorkerOptions, settings: KilnSettings, storage_settings: StorageSettings
) -> tuple[Node | None, Maintenance | None]:
    """Build and warm up the node, bind `run_job` to it, start its loops; (None, None) without
    a pipeline."""
    if not options.pipelines:
        return None, None
    # Imported here: a webhooks-only worker never loads torch.
    from kiln.gpu_worker.config import GroupConfig
    from kiln.gpu_worker.parallel import ParallelSpec
    from kiln.gpu_worker.settings import GpuWorkerSettings
    from kiln.tasks.node.jobs import register_run_job
    from kiln.tasks.node.maintenance import Maintenance
    from kiln.tasks.node.node import Node

    group = GroupConfig.from_settings(
        GpuWorkerSettings(),
        devices=split_devices(options.devices),
        pipelines=options.pipelines,
        parallel=ParallelSpec(mode=options.parallel),  # type: ignore[arg-type]
        max_batch=options.max_batch,
        batch_window_s=options.batch_window_ms / 1000.0,
        deadline_grace_s=settings.deadline_grace_s,
        node_name=options.node_id or "node",
    )
    node = Node(group, settings, storage_settings, celery_app=app, node_id=options.node_id)
    register_run_job(app, node)  # run_job gets this node; consumed only once worker_main runs
    node.start()
    maintenance = Maintenance(node)
    maintenance.start()
    _hand_back_after_grace_on_shutdown(node, settings.drain_grace_s)
    log.info("node %s serving %s on %s", node.node_id, sorted(options.pipelines), options.devices)
    return node, maintenance


def _hand_back_after_grace_on_shutdown(node: Node, grace_s: float) -> None:
    def on_shutting_down(**_: Any) -> None:
        node.draining.set()
        timer = threading.Timer(grace_s, node.hand_back_all)
        timer.daemon = True
        timer.start()

    worker_shutting_down.connect(on_shutting_down, weak=False)
