"""A node's Prometheus metrics, served by `kiln worker` on `KILN_METRICS_HOST`:`KILN_METRICS_PORT`.

Loopback by default, as the API (containers set 0.0.0.0 for Prometheus); port 0: not served.

Every series carries the node's `node_id` label (deploy/prometheus.yml scrapes each node as its own
target and adds no label of its own; deploy/grafana/kiln-dashboard.json groups by `node_id`).

- Read at scrape time from the node itself (a custom collector, no work on the job path):
  `kiln_node_jobs_running`; from the coordinator's counters (`gpu_worker.counters`):
  `kiln_node_denoise_steps_total{pipeline}` (denoising steps x outputs of each forward),
  `kiln_node_group_busy_seconds_total` (time a batch was on the group: its rate is the busy
  ratio), `kiln_node_batch_size` (outputs per forward), `kiln_node_peak_memory_bytes{device}` (the
  last forward's peak, the max over the group's ranks; `device` is the group's devices) and
  `kiln_node_group_rebuilds_total{reason}` (rank_died, killed, start_failed); the ledger's
  `kiln_node_gpu_seconds_total` (devices x time since the group was first ready) and
  `kiln_node_idle_gpu_seconds_total` (of those, with no batch on the group).
- Counted where they happen: `kiln_node_stage_duration_seconds{stage}` (queue, load, denoise,
  decode, encode, upload: see `JobRunner`), `kiln_node_ooms_total{pipeline}` (job attempts that
  failed out of memory, device or host), `kiln_node_lease_renewal_failures_total` (a renewal
  refused or failed against Redis), `kiln_node_upload_retries_total` (object-store calls retried),
  `kiln_node_wake_seconds` (what a job waited for its sleeping group to wake),
  `kiln_node_job_events_total{type}` (job events through the node's event sink: its listener),
  `kiln_checkpoints_written_total{pipeline}`, `kiln_checkpoint_write_seconds{pipeline}` and
  `kiln_checkpoint_write_bytes{pipeline}` (step checkpoints written and recorded: the write's
  time, put and record, and its size).

Each node has its own registry (never the process-wide default), with the process's own metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kiln.gpu_worker.counters import GroupCounters
from kiln.tasks.webhooks.event_sink import EventNote

log = logging.getLogger(__name__)

MB = 1024 * 1024
STAGES = ("queue", "load", "denoise", "decode", "encode", "upload")
STAGE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CHECKPOINT_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
CHECKPOINT_BYTES_BUCKETS = tuple(float(MB * 2**i) for i in range(0, 14, 2))  # 1 MiB .. 4 GiB


class NodeMetrics:
    """The node's registry and the metrics its job path, heartbeat and uploads count.

    `scraped` is what the node gives to be read at each scrape (its `GroupCollector`).
    """

    def __init__(self, node_id: str, pipelines: Iterable[str], scraped: Collector) -> None:
        self.node_id = node_id
        self.registry = CollectorRegistry()
        labels = ["node_id"]
        self.stage_seconds = Histogram(
            "kiln_node_stage_duration_seconds",
            "Time a job spent in each stage of one attempt on this node.",
            [*labels, "stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.ooms = Counter(
            "kiln_node_ooms",
            "Job attempts that failed out of memory (device or host).",
            [*labels, "pipeline"],
            registry=self.registry,
        )
        self.lease_renewal_failures = Counter(
            "kiln_node_lease_renewal_failures",
            "Lease renewals refused (token superseded) or failed (Redis error).",
            labels,
            registry=self.registry,
        )
        self.wake_seconds = Histogram(
            "kiln_node_wake_seconds",
            "Time a job waited for its sleeping worker group to wake (KILN_IDLE_SLEEP_S).",
            labels,
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.upload_retries = Counter(
            "kiln_node_upload_retries",
            "Object-store calls of an upload retried after a retryable error.",
            labels,
            registry=self.registry,
        )
        self.job_events = Counter(
            "kiln_node_job_events",
            "Job events this node wrote or announced, by type (heard from its event sink).",
            [*labels, "type"],
            registry=self.registry,
        )
        self.checkpoints_written = Counter(
            "kiln_checkpoints_written",
            "Step checkpoints this node's attempts wrote and recorded.",
            [*labels, "pipeline"],
            registry=self.registry,
        )
        self.checkpoint_seconds = Histogram(
            "kiln_checkpoint_write_seconds",
            "Time to write one step checkpoint: its put to the object store and its record.",
            [*labels, "pipeline"],
            buckets=CHECKPOINT_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.checkpoint_bytes = Histogram(
            "kiln_checkpoint_write_bytes",
            "Size of one step checkpoint written.",
            [*labels, "pipeline"],
            buckets=CHECKPOINT_BYTES_BUCKETS,
            registry=self.registry,
        )
        self.preemptions = Counter(
            "kiln_node_preemptions",
            "Running jobs this node suspended at a step boundary (checkpointed, queued again at "
            "the head of their lane) for a waiting interactive job.",
            [*labels, "pipeline"],
            registry=self.registry,
        )
        # Present (at 0) from the first scrape, so rate() and increase() have a start.
        self.lease_renewal_failures.labels(self.node_id)
        self.upload_retries.labels(self.node_id)
        for pipeline in pipelines:
            self.ooms.labels(self.node_id, pipeline)
            self.preemptions.labels(self.node_id, pipeline)
            self.checkpoints_written.labels(self.node_id, pipeline)
            self.checkpoint_seconds.labels(self.node_id, pipeline)
            self.checkpoint_bytes.labels(self.node_id, pipeline)
        self.registry.register(scraped)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._server: WSGIServer | None = None

    def observe_stage(self, stage: str, seconds: float) -> None:
        """One job attempt spent `seconds` in `stage` (one of STAGES)."""
        self.stage_seconds.labels(self.node_id, stage).observe(max(0.0, seconds))

    def observe_wake(self, seconds: float) -> None:
        """A job attempt waited `seconds` for the group to wake (0: it was awake, not counted)."""
        if seconds > 0:
            self.wake_seconds.labels(self.node_id).observe(seconds)

    def count_oom(self, pipeline: str) -> None:
        """A job attempt on `pipeline` failed out of memory."""
        self.ooms.labels(self.node_id, pipeline).inc()

    def observe_checkpoint(self, pipeline: str, seconds: float, size: int) -> None:
        """A step checkpoint of `size` bytes was written and recorded in `seconds`."""
        self.checkpoints_written.labels(self.node_id, pipeline).inc()
        self.checkpoint_seconds.labels(self.node_id, pipeline).observe(max(0.0, seconds))
        self.checkpoint_bytes.labels(self.node_id, pipeline).observe(size)

    def count_preemption(self, pipeline: str) -> None:
        """A running job of `pipeline` was suspended for a waiting interactive job."""
        self.preemptions.labels(self.node_id, pipeline).inc()

    def count_lease_renewal_failure(self) -> None:
        """A lease renewal was refused or failed."""
        self.lease_renewal_failures.labels(self.node_id).inc()

    def count_event(self, note: EventNote) -> None:
        """A job event went through the node's sink (its listener: tasks/webhooks/event_sink.py)."""
        self.job_events.labels(self.node_id, note.type).inc()

    def count_upload_retry(self) -> None:
        """An object-store call of an upload is being retried."""
        self.upload_retries.labels(self.node_id).inc()

    def serve(self, port: int, addr: str = "127.0.0.1") -> bool:
        """Serve /metrics on `addr`:`port` (0: not served); a port in use is logged, never fatal."""
        if port == 0:
            return False
        try:
            self._server, _ = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:
            log.error("node metrics: cannot listen on %s:%d (%s); not served", addr, port, exc)
            return False
        log.info("node metrics on http://%s:%d/metrics", addr, port)
        return True

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class GroupCollector(Collector):
    """The series read at scrape time: the node's running jobs and its coordinator's counters.

    `jobs_running` counts the jobs the node's group has started; `coordinator` is the node's
    (a test's fake may have no counters); `devices` labels the peak memory.
    """

    def __init__(
        self, node_id: str, devices: str, jobs_running: Callable[[], int], coordinator: Any
    ) -> None:
        self._node_id = node_id
        self._devices = devices
        self._jobs_running = jobs_running
        self._coordinator = coordinator

    def collect(self) -> Iterable[Metric]:
        """Jobs running now, then the coordinator's cumulative counters."""
        node_id = self._node_id
        running = GaugeMetricFamily(
            "kiln_node_jobs_running",
            "Jobs this node's group has started and not finished.",
            labels=["node_id"],
        )
        running.add_metric([node_id], self._jobs_running())
        yield running
        counters = _counters(self._coordinator)
        if counters is None:
            return
        yield from group_families(node_id, self._devices, counters)


def _counters(coordinator: Any) -> GroupCounters | None:
    # A test's fake coordinator may have no counters: those series are then left out.
    read = getattr(coordinator, "counters", None)
    if read is None:
        return None
    counters = read()
    return counters if isinstance(counters, GroupCounters) else None


BUSY_HELP = "Wall time the worker group spent on a batch."
HELD_HELP = (
    "GPU-seconds the node held warm: its group's devices x the time since it was first ready."
)
IDLE_HELP = "GPU-seconds the node held warm with no batch on its group (held - jobs' GPU-seconds)."


def group_families(node_id: str, devices: str, counters: GroupCounters) -> Iterable[Metric]:
    """The coordinator's counters as metric families (node_id label on each)."""
    steps = CounterMetricFamily(
        "kiln_node_denoise_steps",
        "Denoising steps run, each output of a batched forward counted.",
        labels=["node_id", "pipeline"],
    )
    for pipeline, count in sorted(counters.steps.items()):
        steps.add_metric([node_id, pipeline], count)
    yield steps
    # its wall time on batches; the ledger's node totals (kiln/common/ledger.py): GPU-seconds held
    # warm, and of those idle
    for name, what, value in (
        ("kiln_node_group_busy_seconds", BUSY_HELP, counters.busy_s),
        ("kiln_node_gpu_seconds", HELD_HELP, counters.held_gpu_s),
        ("kiln_node_idle_gpu_seconds", IDLE_HELP, counters.idle_gpu_s),
    ):
        family = CounterMetricFamily(name, what, labels=["node_id"])
        family.add_metric([node_id], value)
        yield family
    yield _batch_sizes(node_id, counters.batch_sizes)
    if counters.peak_memory_mb is not None:
        peak = GaugeMetricFamily(
            "kiln_node_peak_memory_bytes",
            "Peak memory of the last forward (max over the group's ranks).",
            labels=["node_id", "device"],
        )
        peak.add_metric([node_id, devices], counters.peak_memory_mb * MB)
        yield peak
    rebuilds = CounterMetricFamily(
        "kiln_node_group_rebuilds",
        "Worker groups replaced, by reason (rank_died, killed, start_failed).",
        labels=["node_id", "reason"],
    )
    for reason, count in sorted(counters.rebuilds.items()):
        rebuilds.add_metric([node_id, reason], count)
    yield rebuilds


def _batch_sizes(node_id: str, sizes: dict[int, int]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(
        "kiln_node_batch_size", "Outputs per forward of the worker group.", labels=["node_id"]
    )
    buckets: list[tuple[str, float]] = []
    for bound in BATCH_SIZE_BUCKETS:
        buckets.append((str(bound), float(sum(n for size, n in sizes.items() if size <= bound))))
    buckets.append(("+Inf", float(sum(sizes.values()))))
    total = float(sum(size * n for size, n in sizes.items()))
    family.add_metric([node_id], buckets, sum_value=total)
    return family
