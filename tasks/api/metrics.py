"""The API's Prometheus metrics, served on its own port at `GET /metrics` (no API key: scrapers).

- `kiln_api_requests_total{route,status}`: every HTTP request, by route template (`/v1/jobs/
  {job_id}`, never the raw path; `unmatched` for a path no route serves) and status code.
- `kiln_api_submit_duration_seconds`: how long `POST /v1/jobs` took, answer sent.
- `kiln_queue_depth{queue}` and `kiln_jobs{state}`: read from Redis when scraped (two pipelined
  round trips): messages waiting in each Celery queue (`lane.pipeline` for every known pipeline,
  and `webhooks`), and job records per state. `kiln_jobs` counts records, which expire after the
  retention: it is no count of jobs run; the counters below are.
- `kiln_jobs_finished_total{pipeline,lane,state}`, `kiln_batch_lines_finished_total{state}` and
  `kiln_batches_finished_total{state}`: monotonic counters kept in Redis (storage/counters.py),
  added to by the step that ends each job, batch line or batch, so they stay right after records
  expire and read the same from every API process and node. A batch line counts once however it
  ends: by its job's terminal state, ended before it became a job (canceled, expired, failed),
  or `invalid` (refused at submit); `kiln_batches{state}`: batches still
  being fed or finished. Every API instance exports the same deployment-wide values: combine
  instances with max, e.g. lines per second
  `max(sum by (instance) (rate(kiln_batch_lines_finished_total[5m])))`.
  A scrape while Redis is down leaves all of these out.
- Step accounting (docs/contract.md §5b), kept the same way (added by the transition that closes
  each attempt, a dead node's included): `kiln_steps_computed_total`, `kiln_steps_restored_total`
  and `kiln_steps_recomputed_total` (denoising steps), and `kiln_seconds_lost_total` (compute
  seconds of recomputed steps), by pipeline and lane.
- The ledger (docs/contract.md §5c), kept the same way: `kiln_gpu_seconds_total{pipeline,owner}`,
  the GPU-seconds jobs' attempts occupied, by pipeline and owner key id (`-`: no key). Its
  cardinality is pipelines × API keys that ran a job, bounded by the keys an operator creates
  (never by jobs or users' input). Nodes export their own held and idle GPU-seconds.
- The backlog autoscalers read, per known pipeline (tasks/queue/backlog.py has the arithmetic),
  read from Kiln's records at scrape time (prefetched messages still count as queued):
  `kiln_pipeline_queued_gpu_seconds{pipeline,lane}` (queued jobs × the mean recent run time),
  `kiln_pipeline_running_jobs{pipeline}`, `kiln_pipeline_nodes{pipeline,state}` (heartbeats:
  `live`, and among them `asleep` and `draining`) and `kiln_pipeline_desired_nodes{pipeline}`,
  the nodes that start every queued job within its lane's target (KEDA scales on it).

Each app has its own registry (several apps may live in one test process). Under `kiln api
--workers N` the supervisor sets `PROMETHEUS_MULTIPROC_DIR`: the counters and the histogram then
live in files there, and `/metrics` sums every process's (`MultiProcessCollector`); the Redis
series are read as before (one value for the whole deployment, whichever process answers), and
the process metrics (`process_*`) are left out, one process's being no measure of the API.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.common.states import TERMINAL_STATES
from kiln.storage.counters import (
    LINE_STATUSES,
    FinishedCounts,
    finished_counts,
    live_batches,
)
from kiln.storage.dead_letters import DeadLetterStore
from kiln.storage.errors import StorageError
from kiln.storage.gauges import job_counts, list_lengths
from kiln.tasks.api.context import ApiContext
from kiln.tasks.queue.app import transport_options
from kiln.tasks.queue.backlog import node_counts, read_backlogs
from kiln.tasks.queue.lanes import LANES, WEBHOOKS_QUEUE, lane_and_pipeline, queue_name

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's; set by api.supervisor
SUBMIT_ROUTE = ("POST", "/v1/jobs")
SUBMIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


NO_OWNER = "-"  # the owner label of jobs submitted without a key (storage/lua/_machine.lua)

# the step accounting's counters: (its figure in FinishedCounts.steps, name, help)
_STEP_FAMILIES = (
    ("steps_computed", "kiln_steps_computed", "Denoising steps attempts ran."),
    (
        "steps_restored",
        "kiln_steps_restored",
        "Denoising steps attempts took from a step checkpoint instead of computing them.",
    ),
    (
        "steps_recomputed",
        "kiln_steps_recomputed",
        "Denoising steps an attempt computed that an earlier attempt of its job had computed.",
    ),
    (
        "seconds_lost",
        "kiln_seconds_lost",
        "Compute seconds of recomputed steps: lost to interruptions.",
    ),
)


class ApiMetrics:
    """The registry of one API app and the metrics its requests count."""

    def __init__(self, ctx: ApiContext) -> None:
        self.registry = CollectorRegistry()
        shared_dir = os.environ.get(MULTIPROC_ENV)
        # Several processes: the metrics write to files, which the registry's collector sums.
        own = None if shared_dir else self.registry
        self.requests = Counter(
            "kiln_api_requests",
            "HTTP requests answered, by route template and status code.",
            ["route", "status"],
            registry=own,
        )
        self.submit_seconds = Histogram(
            "kiln_api_submit_duration_seconds",
            "Time to answer POST /v1/jobs.",
            buckets=SUBMIT_BUCKETS,
            registry=own,
        )
        self.registry.register(QueueCollector(ctx))
        self.registry.register(FinishedCollector(ctx))
        self.registry.register(BacklogCollector(ctx))
        self.registry.register(DeadLetterCollector(ctx))
        if shared_dir:
            MultiProcessCollector(self.registry, path=shared_dir)  # type: ignore[no-untyped-call]
        else:
            ProcessCollector(registry=self.registry)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request."""
        self.requests.labels(route, str(status)).inc()
        if (method, route) == SUBMIT_ROUTE:
            self.submit_seconds.observe(seconds)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)


class DeadLetterCollector(Collector):
    """`kiln_dead_letters`: the size of the dead-letter set (docs/contract.md §5a), at scrape."""

    def __init__(self, ctx: ApiContext) -> None:
        self._letters = DeadLetterStore(ctx.store.redis, ctx.store.settings)

    def collect(self) -> Iterable[Metric]:
        """The gauge, or nothing while Redis does not answer."""
        try:
            count = self._letters.count()
        except StorageError as exc:
            log.warning("metrics: the dead-letter count left out: %s", exc)
            return
        yield GaugeMetricFamily(
            "kiln_dead_letters",
            "Failed jobs kept as dead letters (at most KILN_DEAD_LETTER_MAX).",
            value=count,
        )


class QueueCollector(Collector):
    """`kiln_queue_depth` and `kiln_jobs`, read from Redis at scrape time."""

    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx
        self._prefix = str(
            transport_options(ctx.settings, ctx.store.settings.redis_namespace)["global_keyprefix"]
        )

    def collect(self) -> Iterable[Metric]:
        """Both families, or neither while Redis does not answer."""
        try:
            queues = self.queues()
            lengths = list_lengths(self._ctx.store, [self._prefix + q for q in queues])
            counts = job_counts(self._ctx.store)
        except StorageError as exc:
            log.warning("metrics: queue depth and job counts left out: %s", exc)
            return
        depth = GaugeMetricFamily(
            "kiln_queue_depth", "Messages waiting in each Celery queue.", labels=["queue"]
        )
        for queue, length in zip(queues, lengths, strict=True):
            depth.add_metric([queue], length)
        yield depth
        jobs = GaugeMetricFamily(
            "kiln_jobs",
            "Job records per state (retained finished ones included).",
            labels=["state"],
        )
        for state, count in counts.items():
            jobs.add_metric([str(state)], count)
        yield jobs

    def queues(self) -> list[str]:
        """Every lane of every known pipeline, then the webhooks queue."""
        pipelines = self._ctx.submitter.known_pipelines()
        return [queue_name(lane, p) for lane in LANES for p in pipelines] + [WEBHOOKS_QUEUE]


class FinishedCollector(Collector):
    """The counters of finished jobs, batch lines and batches, and live batches, from Redis."""

    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    def collect(self) -> Iterable[Metric]:
        """The four families, or none while Redis does not answer."""
        try:
            counts = finished_counts(self._ctx.store)
            live = live_batches(self._ctx.store)
        except StorageError as exc:
            log.warning("metrics: finished-job and batch counters left out: %s", exc)
            return
        yield self.jobs_finished(counts)
        yield from self.steps(counts)
        yield gpu_seconds(counts, self._ctx.submitter.known_pipelines())
        lines = CounterMetricFamily(
            "kiln_batch_lines_finished",
            "Batch lines that ended, by the status of their result: their job's terminal state, "
            "that of a line ended before it became a job, or invalid (refused at submit).",
            labels=["state"],
        )
        for status in LINE_STATUSES:
            lines.add_metric([status], counts.lines.get(status, 0))
        yield lines
        batches_finished = CounterMetricFamily(
            "kiln_batches_finished", "Batches that ended, by final status.", labels=["state"]
        )
        for status, count in sorted(counts.batches.items()):
            batches_finished.add_metric([status], count)
        yield batches_finished
        batches = GaugeMetricFamily(
            "kiln_batches", "Batches still being fed or finished, by status.", labels=["state"]
        )
        for status, count in sorted(live.items()):
            batches.add_metric([status], count)
        yield batches

    def steps(self, counts: FinishedCounts) -> Iterable[CounterMetricFamily]:
        """The step accounting's sums by pipeline and lane; every known pipeline's from 0."""
        for figure, name, what in _STEP_FAMILIES:
            by_labels = {
                (pipeline, str(known_lane)): 0.0
                for pipeline in self._ctx.submitter.known_pipelines()
                for known_lane in LANES
            }
            for (queue, counted), value in counts.steps.items():
                if counted == figure:
                    lane, pipeline = lane_and_pipeline(queue)
                    by_labels[pipeline, lane] = by_labels.get((pipeline, lane), 0.0) + value
            family = CounterMetricFamily(name, what, labels=["pipeline", "lane"])
            for labels, value in sorted(by_labels.items()):
                family.add_metric(list(labels), value)
            yield family

    def jobs_finished(self, counts: FinishedCounts) -> CounterMetricFamily:
        """Jobs finished by pipeline, lane and state; every known pipeline's series from 0."""
        by_labels: dict[tuple[str, str, str], int] = {}
        for pipeline in self._ctx.submitter.known_pipelines():
            for known_lane in LANES:
                for state in TERMINAL_STATES:
                    by_labels[pipeline, str(known_lane), str(state)] = 0
        for (queue, state), count in counts.jobs.items():
            lane, pipeline = lane_and_pipeline(queue)
            key = (pipeline, lane, str(state))
            by_labels[key] = by_labels.get(key, 0) + count
        family = CounterMetricFamily(
            "kiln_jobs_finished",
            "Jobs that reached a terminal state, by pipeline, lane and state.",
            labels=["pipeline", "lane", "state"],
        )
        for labels, count in sorted(by_labels.items()):
            family.add_metric(list(labels), count)
        return family


class BacklogCollector(Collector):
    """Per pipeline: queued GPU-seconds, running jobs, nodes and desired nodes, from Redis."""

    def __init__(self, ctx: ApiContext) -> None:
        self._ctx = ctx

    def collect(self) -> Iterable[Metric]:
        """The four families, or none while Redis does not answer."""
        ctx = self._ctx
        pipelines = ctx.submitter.known_pipelines()
        try:
            backlogs = read_backlogs(ctx.store, ctx.settings, pipelines)
            live = ctx.store.live_nodes()
        except StorageError as exc:
            log.warning("metrics: pipeline backlogs left out: %s", exc)
            return
        queued = GaugeMetricFamily(
            "kiln_pipeline_queued_gpu_seconds",
            "Queued work in estimated GPU-seconds (queued jobs x mean recent run time).",
            labels=["pipeline", "lane"],
        )
        running = GaugeMetricFamily(
            "kiln_pipeline_running_jobs", "Running jobs.", labels=["pipeline"]
        )
        nodes = GaugeMetricFamily(
            "kiln_pipeline_nodes",
            "Live nodes serving the pipeline (heartbeats); asleep and draining are among them.",
            labels=["pipeline", "state"],
        )
        desired = GaugeMetricFamily(
            "kiln_pipeline_desired_nodes",
            "Nodes that would start every queued job within its lane's target start.",
            labels=["pipeline"],
        )
        for backlog in backlogs:
            name = backlog.pipeline
            for lane, seconds in backlog.queued_gpu_s.items():
                queued.add_metric([name, lane], seconds)
            running.add_metric([name], backlog.running_jobs)
            counts = node_counts(live, name)
            for state, count in (
                ("live", counts.live),
                ("asleep", counts.asleep),
                ("draining", counts.draining),
            ):
                nodes.add_metric([name, state], count)
            desired.add_metric([name], backlog.desired_nodes)
        yield from (queued, running, nodes, desired)


class RequestMetrics:
    """ASGI middleware counting every request once it is answered (or failed)."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; count it by the route the router matched."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets when the app raises before answering
        counted = False

        def count() -> None:
            nonlocal counted
            counted = True
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe(scope["method"], route, status, time.perf_counter() - started)

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # Counted before the last byte leaves: a client that got its answer and then
                # scrapes /metrics sees its own request counted.
                count()
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            if not counted:
                count()


def install_metrics(app: FastAPI, ctx: ApiContext) -> ApiMetrics:
    """Add `GET /metrics` and the request counting to `app` (call after other middleware)."""
    metrics = ApiMetrics(ctx)

    def serve_metrics(_: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.add_route(METRICS_PATH, serve_metrics, methods=["GET"], include_in_schema=False)
    app.add_middleware(RequestMetrics, metrics=metrics)
    app.state.metrics = metrics
    return metrics


def gpu_seconds(counts: FinishedCounts, pipelines: Iterable[str]) -> CounterMetricFamily:
    """The ledger's GPU-seconds by pipeline and owner key id (kiln/common/ledger.py).

    Every known pipeline has its keyless series (owner `-`) from 0, so the family is exported
    before any job ran and `increase()` has a start.
    """
    family = CounterMetricFamily(
        "kiln_gpu_seconds",
        "GPU-seconds jobs' attempts occupied (a batch's seconds x devices, shared by work), by "
        "pipeline and owner key id.",
        labels=["pipeline", "owner"],
    )
    by_labels = {(pipeline, NO_OWNER): 0.0 for pipeline in pipelines}
    by_labels.update(counts.gpu)
    for (pipeline, owner), value in sorted(by_labels.items()):
        family.add_metric([pipeline, owner], value)
    return family
