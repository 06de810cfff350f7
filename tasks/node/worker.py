"""`kiln worker`: a Celery worker (threads pool) whose main process owns one node.

The node (coordinator + GPU group) starts and warms up before the worker consumes anything, and
stops after the worker has finished. SIGTERM: Celery stops consuming and waits for the running
tasks; Kiln hands back at once the jobs that take step checkpoints (each checkpoints its next
step first) and, after `drain_grace_s`, the others still running (tasks/node/drain.py), so the
worker exits within the grace and no job is lost. With `preemption_notice_url` set, a spot
machine's notice sends the process that SIGTERM (tasks/node/preemption.py).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from celery.exceptions import SecurityWarning
from celery.signals import worker_ready, worker_shutting_down

from kiln.common.tracing import start_tracing
from kiln.gpu_worker.errors import RankStartupFailed
from kiln.gpu_worker.pipeline_specs import PipelineFailed, PipelineRefused
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.node.worker_logs import start_worker_logging
from kiln.tasks.node.worker_options import (
    WorkerOptions,
    parse_lanes,
    parse_pipelines,
    split_devices,
    worker_queues,
)
from kiln.tasks.queue.lanes import WEBHOOKS_QUEUE, node_queues
from kiln.tasks.queue.process import ProcessParts, this_process

if TYPE_CHECKING:  # the node's modules load torch; a webhooks-only worker never imports them
    from kiln.gpu_worker.config import GroupConfig
    from kiln.gpu_worker.settings import GpuWorkerSettings
    from kiln.tasks.node.maintenance import Maintenance
    from kiln.tasks.node.node import Node

log = logging.getLogger(__name__)

# `kiln worker`'s options live in tasks/node/worker_options.py; these are imported from here too
__all__ = [
    "PipelineFailed",
    "PipelineRefused",
    "WorkerOptions",
    "group_settings",
    "parse_lanes",
    "parse_pipelines",
    "run_worker",
]

WEBHOOKS_ONLY_NOTICE = (
    "kiln worker: no --pipeline given, so this worker serves no pipeline and only delivers "
    f"webhooks (queue {WEBHOOKS_QUEUE!r})"
)


def run_worker(options: WorkerOptions) -> None:
    """Start the node (if it serves pipelines), then the Celery worker; stop both at the end.

    A spec only loading shows to be wrong (a factory that returned no pipeline) ends the start
    with `PipelineRefused`: its name and the reason, one line, for the CLI to print as it is; a
    pipeline whose loading or warm-up raised, with `PipelineFailed` (the same, another code).
    """
    parts = this_process()
    settings, storage_settings = parts.settings, parts.storage_settings
    if options.pipelines and options.node_id is None:
        from kiln.tasks.node.node import default_node_id  # loads torch: nodes only

        options = replace(options, node_id=default_node_id())  # one id for logs, ranks, metrics
    capture = start_worker_logging(
        settings.log_format, options.loglevel, options.node_id, spawns_ranks=bool(options.pipelines)
    )
    log.info("kiln worker: %s", storage_settings.describe())  # which Redis, namespace, store
    # spans only where the OTEL_* variables ask (off by default); each rank 0 starts its own
    start_tracing("kiln-node" if options.pipelines else "kiln-webhooks")
    try:
        _run_worker(options, parts)
    finally:
        if capture is not None:
            capture.stop()
        # The process exits next. Its final garbage collection would walk every object torch,
        # Celery and the pipelines left behind (1-2 s on a node); frozen, they are skipped.
        gc.freeze()


def _run_worker(options: WorkerOptions, parts: ProcessParts) -> None:
    settings, app = parts.settings, parts.celery_app
    if not options.pipelines:
        # Printed, not logged: Celery sets logging up only later, inside `worker_main`.
        print(WEBHOOKS_ONLY_NOTICE, file=sys.stderr, flush=True)
    node, maintenance = _start_node(options, parts)
    groups = len(node.group_config.world()) // node.group_size if node else 1
    concurrency = options.concurrency or (2 * options.max_batch * groups if node else 8)
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
    if settings.log_format == "json":
        argv.insert(0, "--quiet")  # `celery --quiet worker`: no text banner, only JSON lines
    held = maintenance.controls.held_at_start if maintenance and maintenance.controls else []
    if held:  # paused queues (all, while draining): never consumed until the operator says so
        argv.append(f"--exclude-queues={','.join(held)}")
    asked_to_stop = threading.Event()
    worker_shutting_down.connect(lambda **_: asked_to_stop.set(), weak=False)
    # Celery warns at every start as root (the default in containers): root plus pickle would let
    # a message run code (with pickle accepted it refuses to start unless C_FORCE_ROOT is set).
    # Kiln's app accepts JSON only (tasks/queue/app.py): the risk named is not one Kiln runs.
    # Celery's other security warnings still show.
    warnings.filterwarnings(
        "ignore",
        message="You're running the worker with superuser privileges",
        category=SecurityWarning,
        module=r"celery\.platforms",
    )
    try:
        app.worker_main(argv)
    finally:
        if maintenance is not None:
            maintenance.stop()
        if node is not None:
            node.shutdown()
            node.metrics.stop()
    _fail_unless_asked(asked_to_stop)


def _fail_unless_asked(asked_to_stop: threading.Event) -> None:
    """Exit 1 if Celery stopped on its own rather than on a signal or an operator's drain.

    An "Unrecoverable error" (kombu's Redis transport can hit one when Redis restarts under load)
    returns from `worker_main` just as a SIGTERM does. A non-zero status makes the supervisor
    (compose: `restart: unless-stopped`) start the node again; meanwhile the other nodes take its
    leases and held messages.
    """
    if not asked_to_stop.is_set():
        log.error("the Celery worker stopped without being asked to; exiting with status 1")
        raise SystemExit(1)


def _start_node(
    options: WorkerOptions, parts: ProcessParts
) -> tuple[Node | None, Maintenance | None]:
    """Build and warm up the node, bind `run_job` to it, start its loops.

    (None, None) without a pipeline.
    """
    if not options.pipelines:
        return None, None
    from kiln.gpu_worker.rank_server import warm_rank_server  # torch-free

    gpu_settings = group_settings(options)
    # it imports torch (and diffusers, for such pipelines) while this process does too
    warm_rank_server(gpu_settings.rank_start, options.pipelines.values())
    # Imported here: a webhooks-only worker never loads torch.
    from kiln.tasks.node.compile_store import fetch_compile_cache, publish_compile_cache
    from kiln.tasks.node.controls import CeleryConsumers, NodeControls
    from kiln.tasks.node.held import track_held_deliveries
    from kiln.tasks.node.jobs import register_run_job
    from kiln.tasks.node.maintenance import Maintenance
    from kiln.tasks.node.node import Node

    settings, app = parts.settings, parts.celery_app
    group = _group_config(options, settings, gpu_settings)
    node = Node(
        group,
        parts,
        node_id=options.node_id,
        group_size=options.group_size,
    )
    register_run_job(app, node)  # run_job gets this node; consumed only once worker_main runs
    track_held_deliveries(node.held, app, node.submitter.owe)
    # scrapeable while the group warms up
    node.metrics.serve(settings.metrics_port, settings.metrics_host)
    fetch_compile_cache(node.objects, gpu_settings, group.devices)  # a fresh volume warms up
    _start_group(node)
    publish_compile_cache(node.objects, gpu_settings, group.devices)
    consumers = CeleryConsumers(app)
    controls = NodeControls(node, node_queues(options.lanes, list(options.pipelines)), consumers)
    controls.start_queues()  # pauses and drain as they are now, before anything is consumed
    worker_ready.connect(lambda sender, **_: consumers.ready(str(sender.hostname)), weak=False)
    maintenance = Maintenance(node, controls)
    maintenance.start()
    _drain_on_shutdown(node, settings)
    log.info("node %s serving %s on %s", node.node_id, sorted(options.pipelines), options.devices)
    return node, maintenance


def _start_group(node: Node) -> None:
    """Start the node's group; `PipelineRefused` or `PipelineFailed` (one line) from a rank."""
    try:
        node.start()
    except RankStartupFailed as exc:
        text = str(exc)
        refused = PipelineRefused.found_in(text) or PipelineFailed.found_in(text)
        if refused is None:
            raise
        node.metrics.stop()
        raise refused from None


def _group_config(
    options: WorkerOptions, settings: KilnSettings, gpu_settings: GpuWorkerSettings
) -> GroupConfig:
    """The node's worker group as the options and settings describe it."""
    from kiln.gpu_worker.config import GroupConfig
    from kiln.gpu_worker.parallel import ParallelSpec

    return GroupConfig.from_settings(
        gpu_settings,
        devices=split_devices(options.devices),
        pipelines=options.pipelines,
        # `none` is refused on several ranks; on replica groups of one rank `auto` is `none`.
        parallel=ParallelSpec(mode=_whole_node_parallel(options)),  # type: ignore[arg-type]
        max_batch=options.max_batch,
        batch_window_s=options.batch_window_ms / 1000.0,
        deadline_grace_s=settings.deadline_grace_s,
        node_name=options.node_id or "node",
        log_format=settings.log_format,
        log_level=options.loglevel,
    )


def group_settings(options: WorkerOptions) -> GpuWorkerSettings:
    """gpu_worker's settings from the environment, with the flags given on top."""
    from kiln.gpu_worker.settings import GpuWorkerSettings

    flags: dict[str, Any] = {
        "idle_sleep_s": options.idle_sleep_s,
        "sleep_mode": options.sleep_mode,
        "compile": options.compile,
        "warmup": list(options.warmup) or None,
        "lora_dir": options.lora_dir,
    }
    return GpuWorkerSettings(**{name: value for name, value in flags.items() if value is not None})


def _whole_node_parallel(options: WorkerOptions) -> str:
    """The parallel mode of the node's config over all its devices (split into groups later)."""
    if options.parallel == "none" and options.group_size == 1:
        return "auto"  # each one-rank group then runs `none`, as asked
    return options.parallel


def _drain_on_shutdown(node: Node, settings: KilnSettings) -> None:
    """SIGTERM drains the node (tasks/node/drain.py); a preemption notice sends that SIGTERM."""
    from kiln.tasks.node.drain import start_drain
    from kiln.tasks.node.preemption import PreemptionWatcher, terminate_this_process

    watcher = None
    if settings.preemption_notice_url:
        watcher = PreemptionWatcher(
            settings.preemption_notice_url,
            settings.preemption_notice_kind,
            settings.preemption_poll_s,
            lambda _notice: terminate_this_process(),
        )
        watcher.start()

    def on_shutting_down(**_: Any) -> None:
        if watcher is not None:
            watcher.stop()
        start_drain(node, settings.drain_grace_s)

    worker_shutting_down.connect(on_shutting_down, weak=False)
