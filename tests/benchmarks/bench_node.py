"""Kiln node benchmarks versus direct calls and a hand-written Celery worker (a script).

    .venv/bin/python tests/benchmarks/bench_node.py [--jobs 200] [--overhead-jobs 100]
        [--only overhead,busy,throughput] [--busy-batches 4,1] [--busy-size PX] [--sleep 0.2]
        [--threads 1] [--node-concurrency N]

Needs the Redis at KILN_TEST_REDIS_URL (default redis://127.0.0.1:6379/0); every key goes under
random `kiln-bench-*` namespaces, deleted at the end. Starts, from this process: a moto S3 server
(ThreadedMotoServer on 127.0.0.1, in this process), real `kiln worker` nodes (one CPU rank each,
`--max-batch 4` and `--max-batch 1`, both pipelines resident) and the hand-written baseline
(tests/benchmarks/baseline_worker.py: solo pool, acks_late, prefetch 1), each with its own
namespace and bucket. Kiln runs with its default settings. All sides run in one script run and
are compared side by side, because the machine is shared and noisy. ~6 min on 2 cores.

`tiny` is served everywhere as `python:tests.benchmarks.bench_pipelines:tiny`: gpu_worker's tiny
pipeline with --threads torch threads in every process that computes (Kiln's rank, the baseline,
the direct path) and its forwards recorded (see bench_pipelines.py for why).

1. overhead: tiny (64x64, 4 steps, png), one job at a time. Per job, interleaved: the direct
   in-process cost (load_pipeline in this process; run + encode + put to the same S3), then the
   same job on each Kiln node (submit -> the terminal event, read with a blocking XREAD on the
   job's event stream: no polling granularity). Kiln's time is split into 8 consecutive segments
   from its record, its events (Redis TIME) and rank 0's recorded forward.
   With --tracing, two more --max-batch 4 nodes take each job in turn: one exporting its spans
   (OTEL_TRACES_EXPORTER=otlp to a collector in this process; each job given a traceparent), and,
   with --before-tree PATH, one run from that checkout (the tree without tracing: see
   docs/performance.md); the report compares their overhead with the plain node's.
2. busy: the `busy` pipeline sleeps --sleep s PER REQUEST (batching cannot fake it); the image
   size is calibrated in this run so that PNG encode + put is ~30 % of that (printed). Busy = sum
   of forward times recorded on rank 0 / wall from the first forward's start to the last job's
   finished_at; the baseline likewise with its in-process run times.
3. throughput: tiny jobs, all submitted at once; jobs / (last finished_at - first submit).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import boto3  # noqa: E402
import torch  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from kiln.common.states import TERMINAL_STATES, JobState  # noqa: E402
from kiln.gpu_worker.config import available_cores  # noqa: E402
from kiln.gpu_worker.outputs import OutputSpec, encode  # noqa: E402
from kiln.gpu_worker.pipelines import Pipeline, load_pipeline  # noqa: E402
from kiln.gpu_worker.protocol import GenerationRequest  # noqa: E402
from kiln.storage.job_store import JobRecord, JobStore  # noqa: E402
from kiln.storage.objects import ObjectStore, new_attempt_name, output_key  # noqa: E402
from kiln.tasks.contract.schemas import JobRequest  # noqa: E402
from tests.benchmarks.baseline_worker import BaselineProcess  # noqa: E402
from tests.benchmarks.bench_pipelines import image_like  # noqa: E402
from tests.conftest import TEST_REDIS_URL, delete_namespace  # noqa: E402
from tests.e2e.cluster import Cluster, WorkerProcess  # noqa: E402
from tests.span_collector import SpanCollector, span_collector  # noqa: E402

BENCHES = ("overhead", "busy", "throughput")
BUSY_SPEC = "python:tests.benchmarks.bench_pipelines:busy"
TINY_SPEC = "python:tests.benchmarks.bench_pipelines:tiny"  # `tiny`, torch threads pinned
S3_REGION = "us-east-1"
S3_KEY_ID = S3_SECRET = "testing"  # moto accepts any
TERMINAL = {str(state) for state in TERMINAL_STATES}
# the direct path writes as one attempt of a job would (every put creates a fresh key)
ATTEMPT = new_attempt_name(1)
WARMUP_JOBS = 5


# --- statistics --------------------------------------------------------------------------------


def pct(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of samples."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ms(samples: Sequence[float]) -> str:
    """'p50 / p95' in milliseconds."""
    return f"{pct(samples, 0.5) * 1e3:8.1f} {pct(samples, 0.95) * 1e3:8.1f}"


# --- services ----------------------------------------------------------------------------------


@dataclass
class Node:
    """One Kiln node in its own namespace and bucket."""

    max_batch: int
    cluster: Cluster
    worker: WorkerProcess
    forwards: Path


@dataclass
class Services:
    """moto, Redis namespaces, the Kiln nodes and the baseline of this run."""

    tmp: Path
    redis_url: str
    endpoint: str
    sleep_s: float
    threads: int
    concurrency: int = 0  # a Kiln node's --concurrency; 0: its default
    nodes: dict[int, Node] = field(default_factory=dict)
    # --tracing: more --max-batch 4 nodes by label ("traced", "before"), each job run on each
    variants: dict[str, Node] = field(default_factory=dict)
    baseline: BaselineProcess | None = None
    baseline_forwards: Path | None = None
    namespaces: list[str] = field(default_factory=list)

    def _namespace(self, tag: str) -> tuple[str, str, Path]:
        namespace = f"kiln-bench-{tag}-{secrets.token_hex(4)}"
        self.namespaces.append(namespace)
        s3 = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=S3_REGION,
            aws_access_key_id=S3_KEY_ID,
            aws_secret_access_key=S3_SECRET,
        )
        s3.create_bucket(Bucket=namespace)
        folder = self.tmp / namespace
        folder.mkdir()
        return namespace, namespace, folder

    def _env(self, folder: Path) -> dict[str, str]:
        return {
            **os.environ,
            "KILN_REDIS_URL": self.redis_url,
            "KILN_S3_ENDPOINT_URL": self.endpoint,
            "KILN_S3_REGION": S3_REGION,
            "KILN_S3_ADDRESSING_STYLE": "path",
            "KILN_S3_ACCESS_KEY_ID": S3_KEY_ID,
            "KILN_S3_SECRET_ACCESS_KEY": S3_SECRET,
            "KILN_PIPELINES": '["default", "tiny", "busy"]',
            "KILN_TEST_COMPLETIONS": str(folder / "completions.log"),
            "KILN_BENCH_FORWARDS": str(folder / "forwards.log"),
            "KILN_BENCH_SLEEP_S": str(self.sleep_s),
            "KILN_BENCH_TORCH_THREADS": str(self.threads),
            "KILN_CPU_THREADS_PER_RANK": str(self.threads),
            "PYTHONUNBUFFERED": "1",
        }

    def start_node(
        self,
        max_batch: int,
        label: str | None = None,
        extra_env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """Start a `kiln worker` (1 CPU rank; tiny and busy resident); returns at once.

        `label`: a variant of the --max-batch node (--tracing), run from `cwd` where given.
        """
        namespace, bucket, folder = self._namespace(label or f"mb{max_batch}")
        env = {
            **self._env(folder),
            "KILN_REDIS_NAMESPACE": namespace,
            "KILN_STORAGE_URL": f"s3://{bucket}/outputs",
            **(extra_env or {}),
        }
        cluster = Cluster(env=env, tmp=folder)
        worker = cluster.start_worker(
            f"tiny={TINY_SPEC}",
            f"busy={BUSY_SPEC}",
            devices="cpu:1",
            extra_args=[
                "--max-batch",
                str(max_batch),
                "--loglevel",
                "WARNING",
                *(["--concurrency", str(self.concurrency)] if self.concurrency else []),
            ],
            wait=False,
            cwd=cwd or ROOT,
        )
        node = Node(max_batch, cluster, worker, folder / "forwards.log")
        if label is None:
            self.nodes[max_batch] = node
        else:
            self.variants[label] = node

    def start_baseline(self) -> None:
        """Start the hand-written worker (tiny and busy loaded in-process); returns at once."""
        namespace, bucket, folder = self._namespace("baseline")
        self.baseline_forwards = folder / "forwards.log"
        self.baseline = BaselineProcess.start(
            redis_url=self.redis_url,
            namespace=namespace,
            endpoint=self.endpoint,
            bucket=bucket,
            pipelines={"tiny": TINY_SPEC, "busy": BUSY_SPEC},
            env=self._env(folder),
            log_path=folder / "baseline.log",
        )

    def wait_ready(self) -> None:
        """Block until every node and the baseline are loaded and warm."""
        for node in [*self.nodes.values(), *self.variants.values()]:
            node.worker.wait_ready(timeout_s=600)
        if self.baseline is not None:
            self.baseline.wait_ready(timeout_s=600)

    def stop(self) -> None:
        """Stop every process and delete every namespace."""
        for node in [*self.nodes.values(), *self.variants.values()]:
            node.cluster.stop_all()
        if self.baseline is not None:
            self.baseline.stop()
        for namespace in self.namespaces:
            with contextlib.suppress(Exception):
                delete_namespace(self.redis_url, namespace)


@contextlib.contextmanager
def services(
    args: argparse.Namespace, tmp: Path, collector: SpanCollector | None = None
) -> Iterator[Services]:
    """Moto plus the Kiln nodes and baseline the chosen benchmarks need, started in parallel.

    `collector` (--tracing): where the traced node exports its spans.
    """
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    redis_url = TEST_REDIS_URL
    found = Services(
        tmp, redis_url, f"http://{host}:{port}", args.sleep, args.threads, args.node_concurrency
    )
    try:
        batches: set[int] = set(args.busy_batches) if "busy" in args.only else set()
        if "overhead" in args.only:
            batches |= {4, 1}
        if "throughput" in args.only:
            batches.add(4)
        for max_batch in sorted(batches, reverse=True):
            found.start_node(max_batch)
        if collector is not None and "overhead" in args.only:
            # the SDK's own export schedule (5 s), not the tests' quick one
            env = {k: v for k, v in collector.env().items() if k != "OTEL_BSP_SCHEDULE_DELAY"}
            found.start_node(4, "traced", env)
            if args.before_tree is not None:
                found.start_node(4, "before", cwd=args.before_tree)
        if "busy" in args.only or "throughput" in args.only:
            found.start_baseline()
        started = time.monotonic()
        found.wait_ready()
        print(f"# workers ready after {time.monotonic() - started:.1f}s", flush=True)
        yield found
    finally:
        found.stop()
        moto.stop()


# --- requests and waiting ----------------------------------------------------------------------


def job_requests(pipeline: str, count: int, size: int, tag: str) -> list[JobRequest]:
    """`count` png jobs of `pipeline`, size x size, 4 steps, seeds 0.."""
    return [
        JobRequest(pipeline=pipeline, prompt=f"{tag} {i}", width=size, height=size, steps=4,
                   seed=i, output_format="png")
        for i in range(count)
    ]  # fmt: skip


def tiny_requests(count: int, tag: str) -> list[JobRequest]:
    """64x64, 4 steps, png jobs of the tiny pipeline."""
    return job_requests("tiny", count, 64, tag)


def wait_event(store: JobStore, job_id: str, timeout_s: float = 120.0) -> str:
    """Block on the job's event stream (XREAD) until a terminal event; returns its type."""
    deadline = time.monotonic() + timeout_s
    seq = 0
    while time.monotonic() < deadline:
        for event in store.events(job_id, after_seq=seq, block_ms=2000):
            seq = event.seq
            if event.type in TERMINAL:
                return event.type
    raise TimeoutError(f"job {job_id} did not finish in {timeout_s}s")


def wait_all(store: JobStore, job_ids: list[str], timeout_s: float) -> list[JobRecord]:
    """Poll until every job is terminal; returns the records (timestamps are Kiln's own)."""
    deadline = time.monotonic() + timeout_s
    pending = set(job_ids)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(pending)} Kiln jobs still pending after {timeout_s}s")
        batch = sorted(pending)
        for job_id, record in zip(batch, store.get_many(batch), strict=True):
            if record is not None and str(record.state) in TERMINAL:
                pending.discard(job_id)
        time.sleep(0.2)
    records = [r for r in store.get_many(job_ids) if r is not None]
    failed = [r.id for r in records if r.state != JobState.SUCCEEDED]
    if failed:
        raise RuntimeError(f"Kiln jobs did not succeed: {failed[:5]}")
    return records


def wait_baseline(
    baseline: BaselineProcess, job_ids: list[str], timeout_s: float
) -> list[dict[str, str]]:
    """Poll the baseline's status hashes until every job has succeeded."""
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = baseline.statuses(job_ids)
        if all(s.get("state") == "succeeded" for s in statuses):
            return statuses
        if time.monotonic() > deadline or baseline.process.poll() is not None:
            raise TimeoutError("baseline jobs did not finish")
        time.sleep(0.2)


def read_forwards(path: Path, since: float) -> list[tuple[float, float, int]]:
    """(start, end, requests) of every forward recorded at or after `since`."""
    spans = []
    for line in path.read_text().split("\n") if path.exists() else []:
        if line.strip():
            start, end, count = line.split()
            if float(start) >= since:
                spans.append((float(start), float(end), int(count)))
    return sorted(spans)


# --- 1. overhead -------------------------------------------------------------------------------


@dataclass
class OverheadSample:
    """One job: the direct cost next to Kiln's end-to-end latency, record and timeline."""

    direct_run: float
    direct_encode: float
    direct_put: float
    submitted_at: float  # client clock before submit()
    seen_at: float  # client saw the terminal event
    record: JobRecord
    stages: dict[str, float]  # progress stage -> time its event was written (Redis TIME)
    forward: tuple[float, float] = (0.0, 0.0)  # on rank 0, matched after the run

    @property
    def direct(self) -> float:
        """Run + encode + put in this process."""
        return self.direct_run + self.direct_encode + self.direct_put

    @property
    def latency(self) -> float:
        """Submit -> terminal event seen."""
        return self.seen_at - self.submitted_at

    def metric(self, name: str) -> float:
        """A metric from the job record (seconds)."""
        return float(self.record.metrics.get(name, 0.0))

    @property
    def compute(self) -> float:
        """Kiln's forward on rank 0 + encode_s + upload_s (upload: put, + HEAD where read back)."""
        forward = self.forward[1] - self.forward[0]
        return forward + self.metric("encode_s") + self.metric("upload_s")

    def timeline(self) -> list[float]:
        """The 8 consecutive segments of the latency (they sum to it), see TIMELINE."""
        r = self.record
        started, finished = r.started_at or 0.0, r.finished_at or 0.0
        encoding, uploading = self.stages["encoding"], self.stages["uploading"]
        points = [self.submitted_at, r.created_at, started, *self.forward, encoding, uploading]
        points += [finished, self.seen_at]
        return [b - a for a, b in itertools.pairwise(points)]


TIMELINE = [
    "submit() -> record queued (Lua create)",
    "queued -> running (publish, broker, task, lease)",
    "running -> forward starts on rank 0",
    "forward on rank 0 (compute + per-step sync)",
    # The task thread hands the 'encoding' and 'uploading' stages to the progress writer, which
    # writes them while it encodes and uploads: the next three end when those events landed.
    "forward ends -> 'encoding' event written",
    "-> 'uploading' event written (encode)",
    "-> succeeded (rest of upload, succeed)",
    "succeeded -> client sees event (XREAD)",
]


def direct_once(
    pipeline: Pipeline, objects: ObjectStore, request: JobRequest, index: int
) -> tuple[float, float, float]:
    """The same work without Kiln: run, encode, put; returns (run, encode, put) seconds."""
    generation = GenerationRequest(
        f"direct-{index}", "tiny", request.prompt, request.width, request.height, request.steps,
        seed=int(request.seed or 0), guidance_scale=request.guidance_scale,
    )  # fmt: skip
    started = time.perf_counter()
    frames = pipeline.run([generation], lambda _step, _total: None)[0][0]
    ran = time.perf_counter()
    encoded = encode(frames, OutputSpec(format="png"))
    coded = time.perf_counter()
    key = output_key(
        objects.prefix, f"direct-{secrets.token_hex(8)}", 0, encoded.extension, attempt=ATTEMPT
    )
    objects.put(key, encoded.data, encoded.content_type, {})
    return ran - started, coded - ran, time.perf_counter() - coded


def kiln_once(
    cluster: Cluster,
    request: JobRequest,
    direct: tuple[float, float, float],
    trace: dict[str, str] | None = None,
) -> OverheadSample:
    """One Kiln job, submit to terminal event, with its event timeline (`trace`: its context)."""
    submitted_at = time.time()
    record, _ = cluster.intake.submit(request, trace=trace)
    state = wait_event(cluster.store, record.id)
    seen_at = time.time()
    if state != "succeeded":
        raise RuntimeError(f"overhead job {record.id} ended {state}")
    stages = {
        str(event.payload.get("stage")): event.time
        for event in cluster.store.events(record.id, count=100)
        if event.type == "progress"
    }
    record = cluster.store.get(record.id)
    return OverheadSample(*direct, submitted_at, seen_at, record, stages)


def match_forwards(samples: list[OverheadSample], forwards: Path, since: float) -> None:
    """Give each sequential job the rank-0 forward that ran inside its running window."""
    spans = read_forwards(forwards, since)
    for sample in samples:
        started, finished = sample.record.started_at or 0.0, sample.record.finished_at or 0.0
        inside = [(a, b) for a, b, _ in spans if started <= a and b <= finished]
        if len(inside) != 1:
            raise RuntimeError(f"job {sample.record.id}: {len(inside)} forwards in its window")
        sample.forward = inside[0]


def run_overhead(
    found: Services, requests: list[JobRequest]
) -> tuple[dict[int, list[OverheadSample]], dict[str, list[OverheadSample]]]:
    """Direct vs each Kiln node, one job at a time, interleaved so load drift hits all alike.

    Returns the samples per --max-batch node, and per --tracing variant (the traced node's jobs
    each given a traceparent of their own, the `trace_ids` of its samples).
    """
    os.environ["KILN_BENCH_TORCH_THREADS"] = str(found.threads)
    pipeline = load_pipeline(TINY_SPEC, torch.device("cpu"))  # load_pipeline('tiny'), threads set
    objects = found.nodes[4].cluster.objects
    samples: dict[int, list[OverheadSample]] = {b: [] for b in sorted(found.nodes, reverse=True)}
    variants: dict[str, list[OverheadSample]] = {label: [] for label in found.variants}
    warmup = tiny_requests(WARMUP_JOBS, "warm-up")
    began = time.time()
    for index, request in enumerate([*warmup, *requests]):
        direct = direct_once(pipeline, objects, request, index)
        for max_batch in samples:
            sample = kiln_once(found.nodes[max_batch].cluster, request, direct)
            if index >= WARMUP_JOBS:
                samples[max_batch].append(sample)
        for label in variants:
            trace = {"traceparent": traceparent()} if label == "traced" else None
            sample = kiln_once(found.variants[label].cluster, request, direct, trace)
            if index >= WARMUP_JOBS:
                variants[label].append(sample)
    for max_batch, node_samples in samples.items():
        match_forwards(node_samples, found.nodes[max_batch].forwards, began)
    for label, node_samples in variants.items():
        match_forwards(node_samples, found.variants[label].forwards, began)
    return samples, variants


def traceparent() -> str:
    """A fresh W3C traceparent: each traced job's trace of its own."""
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def tracing_lines(
    plain: list[OverheadSample],
    variants: dict[str, list[OverheadSample]],
    collector: SpanCollector,
) -> list[str]:
    """Overhead of the plain --max-batch 4 node beside its variants, and spans per traced job."""
    rows = [("tracing off (this tree)", plain)] + [
        (VARIANT_NAMES[label], samples) for label, samples in variants.items()
    ]
    head = f"one job at a time, {len(plain)} jobs each, interleaved"
    lines = [f"  {head:<52} {'p50 ms':>8} {'p95 ms':>8}"]
    for name, samples in rows:
        lines.append(f"  {name + ': L - D':<52} {ms([x.latency - x.direct for x in samples])}")
        lines.append(
            f"  {name + ': L - own compute':<52} {ms([x.latency - x.compute for x in samples])}"
        )
    base = pct([x.latency - x.direct for x in plain], 0.5)
    for name, samples in rows[1:]:
        delta = (pct([x.latency - x.direct for x in samples], 0.5) - base) * 1e3
        lines.append(f"  {name + ': p50 L - D minus off':<52} {delta:8.1f}")
    traced = variants.get("traced", [])
    if traced:
        ids = {x.record.trace["traceparent"].split("-")[1] for x in traced}
        deadline = time.monotonic() + 30  # the node exports every 5 s (OTEL_BSP_SCHEDULE_DELAY)
        while time.monotonic() < deadline and not ids <= {s.trace_id for s in collector.spans()}:
            time.sleep(0.2)
        spans = [s for s in collector.spans() if s.trace_id in ids]
        lines.append(
            f"  {'traced: spans per job (node and rank 0)':<52} {len(spans) / len(ids):8.1f}"
        )
    return lines


VARIANT_NAMES = {
    "traced": "tracing on (OTLP/HTTP export)",
    "before": "before tracing (--before-tree)",
}


# --- 2. busy ratio and 3. throughput -----------------------------------------------------------


@dataclass
class StreamResult:
    """One side of a stream of jobs submitted at once."""

    label: str
    jobs: int
    wall_s: float  # first submit -> last finished
    forwards: list[tuple[float, float, int]]
    last_finished: float
    encode_s: list[float]
    upload_s: list[float]

    @property
    def per_s(self) -> float:
        """Jobs per second over the wall."""
        return self.jobs / self.wall_s

    @property
    def busy_s(self) -> float:
        """Sum of forward times."""
        return sum(end - start for start, end, _ in self.forwards)

    @property
    def busy_ratio(self) -> float:
        """Busy time / first forward start -> last finished."""
        return self.busy_s / (self.last_finished - self.forwards[0][0])

    def gaps(self) -> list[float]:
        """Idle time between consecutive forwards."""
        return [b[0] - a[1] for a, b in zip(self.forwards, self.forwards[1:], strict=False)]


def run_kiln_stream(found: Services, max_batch: int, requests: list[JobRequest]) -> StreamResult:
    """Submit every request at once to a Kiln node; wait for all."""
    node = found.nodes[max_batch]
    cluster = node.cluster
    started = time.time()
    job_ids = cluster.submit_many(requests)
    records = wait_all(cluster.store, job_ids, timeout_s=120 + 5 * len(requests))
    last = max(float(r.finished_at or 0) for r in records)
    return StreamResult(
        f"Kiln (1 CPU rank, max-batch {max_batch})",
        len(records),
        last - started,
        read_forwards(node.forwards, started),
        last,
        [float(r.metrics["encode_s"]) for r in records],
        [float(r.metrics["upload_s"]) for r in records],
    )


def run_baseline_stream(found: Services, requests: list[JobRequest]) -> StreamResult:
    """Submit every request at once to the baseline worker; wait for all."""
    baseline = found.baseline
    assert baseline is not None
    assert found.baseline_forwards is not None
    job_ids = [secrets.token_hex(12) for _ in requests]
    started = time.time()
    for job_id, request in zip(job_ids, requests, strict=True):
        baseline.submit(job_id, request.model_dump(mode="json"))
    statuses = wait_baseline(baseline, job_ids, timeout_s=120 + 5 * len(requests))
    last = max(float(s["finished_at"]) for s in statuses)
    return StreamResult(
        "hand-written Celery (solo, acks_late, prefetch 1)",
        len(statuses),
        last - started,
        read_forwards(found.baseline_forwards, started),
        last,
        [float(s["encode_s"]) for s in statuses],
        [float(s["upload_s"]) for s in statuses],
    )


def calibrate_busy_size(found: Services, target_s: float) -> int:
    """The image side whose PNG encode + put (here, now) is closest to `target_s`."""
    objects = next(iter(found.nodes.values())).cluster.objects
    print(f"# busy image size: PNG encode + put, target {target_s * 1e3:.0f} ms", flush=True)
    best, best_error = 256, float("inf")
    for size in (128, 192, 256, 320, 384, 448, 512):
        image = image_like(size, size, seed=1)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            encoded = encode(image, OutputSpec(format="png"))
            key = output_key(
                objects.prefix, f"calibrate-{secrets.token_hex(6)}", 0, "png", attempt=ATTEMPT
            )
            objects.put(key, encoded.data, encoded.content_type, {})
            times.append(time.perf_counter() - started)
        cost = statistics.median(times)
        print(f"#   {size}x{size}: {cost * 1e3:6.1f} ms ({len(encoded.data)} bytes)", flush=True)
        if abs(cost - target_s) < best_error:
            best, best_error = size, abs(cost - target_s)
    return best


# --- report ------------------------------------------------------------------------------------


def overhead_lines(max_batch: int, samples: list[OverheadSample]) -> list[str]:
    """The overhead table of one node."""
    s = samples
    rows = [
        ("direct: pipeline run (this process)", [x.direct_run for x in s]),
        ("direct: PNG encode", [x.direct_encode for x in s]),
        ("direct: put to S3", [x.direct_put for x in s]),
        ("direct: total D", [x.direct for x in s]),
        ("Kiln end-to-end L (submit -> succeeded event)", [x.latency for x in s]),
        ("L - D", [x.latency - x.direct for x in s]),
        ("L - Kiln's own forward+encode+upload", [x.latency - x.compute for x in s]),
    ]
    timelines = [x.timeline() for x in s]
    rows += [(f"  {i + 1}. {name}", [t[i] for t in timelines]) for i, name in enumerate(TIMELINE)]
    rows += [
        ("     (run_s metric = forward)", [x.metric("run_s") for x in s]),
        ("     (encode_s metric)", [x.metric("encode_s") for x in s]),
        ("     (upload_s metric: put + verify)", [x.metric("upload_s") for x in s]),
    ]
    head = f"Kiln: 1 CPU rank, --max-batch {max_batch}, {len(s)} jobs"
    lines = [f"  {head:<52} {'p50 ms':>8} {'p95 ms':>8}"]
    lines += [f"  {label:<52} {ms(values)}" for label, values in rows]
    return lines


def stream_lines(result: StreamResult) -> list[str]:
    """Busy ratio, gaps and encode/upload of one side of the busy benchmark."""
    gaps = result.gaps()
    outputs = sum(count for _, _, count in result.forwards)
    return [
        f"  {result.label}",
        f"    busy {result.busy_ratio * 100:5.1f} %  (sum of forwards {result.busy_s:.1f} s / "
        f"{result.last_finished - result.forwards[0][0]:.1f} s)  {result.per_s:.2f} jobs/s",
        f"    forwards {len(result.forwards)} ({outputs / len(result.forwards):.2f} jobs each);"
        f" idle gap between forwards p50/p95 {ms(gaps) if gaps else '-'} ms",
        f"    per job: encode p50 {statistics.median(result.encode_s) * 1e3:.1f} ms, upload "
        f"p50 {statistics.median(result.upload_s) * 1e3:.1f} ms",
    ]


Row = tuple[str, str, str, str, bool]


def overhead_summary(overhead: dict[int, list[OverheadSample]]) -> list[Row]:
    """Goal rows of benchmark 1: L - D and L - Kiln's own compute, p50."""
    rows: list[Row] = []
    for max_batch, samples in overhead.items():
        versus_direct = pct([x.latency - x.direct for x in samples], 0.5) * 1e3
        own = pct([x.latency - x.compute for x in samples], 0.5) * 1e3
        direct = pct([x.direct for x in samples], 0.5) * 1e3
        name = f"overhead p50, max-batch {max_batch}"
        rows.append(
            (
                f"{name}: L - D",
                f"{versus_direct:.1f} ms",
                f"D {direct:.1f} ms",
                "<= 10 ms",
                versus_direct <= 10,
            )
        )
        rows.append(
            (f"{name}: L - own compute", f"{own:.1f} ms", "(record metrics)", "<= 10 ms", own <= 10)
        )
    return rows


def print_report(
    args: argparse.Namespace,
    size: int,
    overhead: dict[int, list[OverheadSample]],
    busy: list[StreamResult],
    throughput: list[StreamResult],
) -> None:
    """Every table, then the summary with goals."""
    print(
        f"\n===== Kiln node benchmarks: {available_cores()} cores, torch threads "
        f"{args.threads} per process on every side ====="
    )
    summary = overhead_summary(overhead)
    if overhead:
        print("\n1. queue + dispatch overhead, tiny 64x64 4 steps png, one job at a time")
        for max_batch, samples in overhead.items():
            print("\n".join(overhead_lines(max_batch, samples)))
    if busy:
        print(
            f"\n2. busy ratio: {args.jobs} jobs, {args.sleep * 1e3:.0f} ms sleep per job, "
            f"{size}x{size} png"
        )
        for result in busy:
            print("\n".join(stream_lines(result)))
        base = busy[-1]
        for result in busy[:-1]:
            summary.append(
                (
                    f"busy ratio, Kiln {result.label.split(', ')[-1][:-1]}",
                    f"{result.busy_ratio:.1%}",
                    f"baseline {base.busy_ratio:.1%}",
                    ">= 95 %",
                    result.busy_ratio >= 0.95,
                )
            )
    if throughput:
        kiln, base = throughput
        print(f"\n3. throughput: {args.jobs} jobs, tiny 64x64 4 steps png, submitted at once")
        for result in throughput:
            print(
                f"  {result.label:<52} {result.per_s:6.2f} jobs/s  ({result.jobs} in "
                f"{result.wall_s:.1f} s)"
            )
            print("\n".join(stream_lines(result)[1:]))
        ratio = kiln.per_s / base.per_s
        summary.append(
            (
                "throughput Kiln / baseline",
                f"{ratio:.2f}x",
                f"{kiln.per_s:.2f} vs {base.per_s:.2f} j/s",
                ">= 1.5x",
                ratio >= 1.5,
            )
        )
    print(f"\n  {'summary':<44} {'Kiln':>9}  {'reference':<22} {'goal':<9} met")
    for name, value, reference, goal, ok in summary:
        print(f"  {name:<44} {value:>9}  {reference:<22} {goal:<9} {'yes' if ok else 'NO'}")


# --- main --------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per benchmark and side")
    parser.add_argument("--only", default=",".join(BENCHES), help="|".join(BENCHES) + ", commas")
    parser.add_argument("--busy-batches", default="4,1", help="Kiln --max-batch values for busy")
    parser.add_argument("--busy-size", type=int, default=0, help="busy image side; 0: calibrate")
    parser.add_argument("--sleep", type=float, default=0.2, help="busy pipeline: s per request")
    parser.add_argument("--overhead-jobs", type=int, default=100, help="sequential jobs in 1.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, every side")
    parser.add_argument(
        "--node-concurrency", type=int, default=0, help="Kiln nodes' --concurrency; 0: default"
    )
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="1.: also a --max-batch 4 node exporting its spans (OTLP/HTTP to this process)",
    )
    parser.add_argument(
        "--before-tree",
        type=Path,
        help="with --tracing: also a node run from this checkout (the tree without tracing)",
    )
    args = parser.parse_args()
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    if set(args.only) - set(BENCHES):
        parser.error(f"--only: unknown {sorted(set(args.only) - set(BENCHES))}")
    args.busy_batches = [int(b) for b in args.busy_batches.split(",") if b.strip()]
    return args


def main() -> None:
    """Start everything, run the chosen benchmarks, print the report."""
    args = parse_args()
    overhead: dict[int, list[OverheadSample]] = {}
    variants: dict[str, list[OverheadSample]] = {}
    busy: list[StreamResult] = []
    throughput: list[StreamResult] = []
    size = args.busy_size
    began = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="kiln-bench-") as folder,
        span_collector() as collector,
        services(args, Path(folder), collector if args.tracing else None) as found,
    ):
        if "overhead" in args.only:
            print("# 1. overhead", flush=True)
            requests = tiny_requests(args.overhead_jobs, "overhead")
            overhead, variants = run_overhead(found, requests)
            if variants:
                tracing = tracing_lines(overhead[4], variants, collector)
        if "busy" in args.only:
            size = size or calibrate_busy_size(found, target_s=0.3 * args.sleep)
            requests = job_requests("busy", args.jobs, size, "busy")
            for max_batch in args.busy_batches:
                print(f"# 2. busy, Kiln max-batch {max_batch}", flush=True)
                busy.append(run_kiln_stream(found, max_batch, requests))
            print("# 2. busy, baseline", flush=True)
            busy.append(run_baseline_stream(found, requests))
        if "throughput" in args.only:
            requests = tiny_requests(args.jobs, "throughput")
            print("# 3. throughput, Kiln", flush=True)
            throughput.append(run_kiln_stream(found, 4, requests))
            print("# 3. throughput, baseline", flush=True)
            throughput.append(run_baseline_stream(found, requests))
    print_report(args, size, overhead, busy, throughput)
    if variants:
        print("\n1b. tracing: the --max-batch 4 node's overhead, tracing off and on")
        print("\n".join(tracing))
    print(f"\n(total {time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
