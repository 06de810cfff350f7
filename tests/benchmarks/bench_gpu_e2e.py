"""The whole Kiln path on a GPU against the hand-written Celery worker, same pipelines (a script).

    .venv/bin/python -m tests.benchmarks.bench_gpu_e2e [--device cuda:0]
        [--pipelines sd3-medium,flux-dev] [--sizes 512,1024] [--steps 28] [--max-batches 1,4]
        [--jobs 4] [--rounds 2] [--overhead-jobs 2]
    .venv/bin/python -m tests.benchmarks.bench_gpu_e2e --small     # the CPU check: tiny shapes

Needs the Redis at KILN_TEST_REDIS_URL (default redis://127.0.0.1:6379/0); every key goes under
random `kiln-bench-*` namespaces, deleted at the end. Starts a moto S3 server on 127.0.0.1 in
this process, one real `kiln worker` node per `--max-batches` value (one rank on `--device`,
Kiln's default settings otherwise) and the hand-written worker (tests/benchmarks/
baseline_worker.py: one Celery task per job, pipeline -> PNG -> put_object, solo pool, acks_late,
prefetch 1) on the same device, each in its own namespace and bucket. Every process builds the
same pipelines from tests/benchmarks/cuda_dit.py: random weights in the real models' shapes
(SD3-medium's 2B MMDiT, FLUX.1-dev's 12B transformer, their VAEs; tiny text encoders), nothing
downloaded. Jobs go in through Kiln's `Submitter` (Redis record + Celery), come out as PNGs in S3.

Per pipeline and size: one untimed warm-up on every side (each node a full batch), then
`--rounds` rounds in which each side in turn gets `--jobs` jobs submitted at once (the order
reversed every round, so a drift hits all sides alike; the sides never run at the same time).
Then `--overhead-jobs` jobs one at a time on each node. Printed per configuration (pipeline,
size, max batch):

- images/s of Kiln and of the hand-written worker (jobs / first submit -> last finished, over
  all rounds), and their ratio;
- GPU busy: the device's utilisation as NVML samples it every 0.1 s (the share of each sample
  period in which a kernel ran), averaged over each side's stream windows; `n/a` on CPU;
- forward busy: the time rank 0 (or the hand-written worker) spent inside the pipeline's forward
  over those windows, from the forwards `KILN_BENCH_FORWARDS` records; measured on CPU too;
- Kiln's overhead per job outside compute, encode and upload: submit -> terminal event seen
  (blocking XREAD), minus rank 0's forward, `encode_s` and `upload_s` (bench_node.py's
  "L - own compute"), p50 of the sequential jobs;
- peak memory of each side's forwards (CUDA peak allocated on a GPU, peak RSS on CPU), max over
  the jobs.

Then the goals: Kiln's GPU busy >= 97 %; >= 2.5x the hand-written worker at 512² with batching
(max batch 4); >= 1.05x at 1024² (overlap of encode and upload with the next forward only).
Time on an H200, estimated from its measured 22 steps/s for the SD3-medium DiT at 512²: a few
minutes per pipeline with the defaults; run `--pipelines sd3-medium` and `--pipelines flux-dev`
as separate commands when a call is limited to 10 minutes. Memory: each of the three processes
holds every pipeline listed (bf16: ~4 GB SD3-medium, ~24 GB FLUX.1-dev).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import boto3  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from kiln.tasks.contract.schemas import JobRequest  # noqa: E402
from tests.benchmarks.baseline_worker import BaselineProcess  # noqa: E402
from tests.benchmarks.bench_node import (  # noqa: E402
    pct,
    read_forwards,
    wait_all,
    wait_baseline,
    wait_event,
)
from tests.benchmarks.cuda_dit import SMOKE_ENV  # noqa: E402
from tests.conftest import TEST_REDIS_URL, delete_namespace  # noqa: E402
from tests.e2e.cluster import Cluster, WorkerProcess  # noqa: E402

# name -> (spec every process loads, guidance scale: SD3 runs CFG, FLUX.1-dev its embedding)
PIPELINES: dict[str, tuple[str, float]] = {
    "sd3-medium": ("python:tests.benchmarks.cuda_dit:recorded_sd3_medium", 5.0),
    "flux-dev": ("python:tests.benchmarks.cuda_dit:recorded_flux_dev", 3.5),
}
S3_REGION = "us-east-1"
S3_KEY_ID = S3_SECRET = "testing"  # moto accepts any
SAMPLE_S = 0.1
BASELINE = "hand-written"
# The table: one row per configuration; bench's test reads it by these names.
COLUMNS = (
    "pipeline",
    "size",
    "steps",
    "max_batch",
    "kiln_img/s",
    "base_img/s",
    "ratio",
    "kiln_gpu_busy",
    "base_gpu_busy",
    "kiln_fwd_busy",
    "base_fwd_busy",
    "kiln_overhead_ms",
    "kiln_peak_MiB",
    "base_peak_MiB",
)
GPU_BUSY_GOAL = 0.97
BATCHED_512_GOAL = 2.5
OVERLAP_1024_GOAL = 1.05


# --- GPU utilisation ---------------------------------------------------------------------------


class GpuBusy:
    """NVML's utilisation of one GPU, sampled every 0.1 s in a thread: (time, fraction) pairs.

    `torch.cuda.utilization` where pynvml is installed, else `nvidia-smi -lms 100` streaming.
    NVML reports the share of its last sample period (1/6 s to 1 s) in which a kernel ran.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._smi: subprocess.Popen[str] | None = None

    def start(self) -> None:
        """Start sampling."""
        import torch

        try:
            torch.cuda.utilization(self.index)
            target = self._sample_torch
        except (ModuleNotFoundError, RuntimeError):
            self._smi = subprocess.Popen(
                ["nvidia-smi", f"--id={self.index}", "--query-gpu=utilization.gpu",
                 "--format=csv,noheader,nounits", f"-lms={int(SAMPLE_S * 1000)}"],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            target = self._sample_smi
        self._thread = threading.Thread(target=target, daemon=True, name="gpu-busy")
        self._thread.start()

    def _sample_torch(self) -> None:
        import torch

        while not self._stop.wait(SAMPLE_S):
            self.samples.append((time.time(), torch.cuda.utilization(self.index) / 100))

    def _sample_smi(self) -> None:
        assert self._smi is not None
        assert self._smi.stdout is not None
        for line in self._smi.stdout:
            if line.strip().isdigit():
                self.samples.append((time.time(), int(line) / 100))

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            self._smi.wait(10)
        if self._thread is not None:
            self._thread.join(10)

    def mean(self, windows: Sequence[tuple[float, float]]) -> float | None:
        """The mean sampled utilisation inside `windows`; None without a sample there."""
        inside = [v for t, v in self.samples if any(a <= t <= b for a, b in windows)]
        return statistics.fmean(inside) if inside else None


# --- services ----------------------------------------------------------------------------------


@dataclass
class Side:
    """One side of the comparison: a Kiln node, or the hand-written worker (`baseline`)."""

    label: str
    max_batch: int
    folder: Path
    cluster: Cluster | None = None
    worker: WorkerProcess | None = None
    baseline: BaselineProcess | None = None

    @property
    def forwards(self) -> Path:
        """Where this side's forwards are recorded (rank 0, or the worker process)."""
        return self.folder / "forwards.log"


@dataclass
class Services:
    """moto, the namespaces, the Kiln nodes and the hand-written worker of this run."""

    args: argparse.Namespace
    tmp: Path
    redis_url: str
    endpoint: str
    nodes: list[Side] = field(default_factory=list)
    baseline: Side | None = None
    namespaces: list[str] = field(default_factory=list)

    def _namespace(self, tag: str) -> tuple[str, Path]:
        namespace = f"kiln-bench-gpu-{tag}-{secrets.token_hex(4)}"
        self.namespaces.append(namespace)
        boto3.client(
            "s3", endpoint_url=self.endpoint, region_name=S3_REGION,
            aws_access_key_id=S3_KEY_ID, aws_secret_access_key=S3_SECRET,
        ).create_bucket(Bucket=namespace)  # fmt: skip
        folder = self.tmp / namespace
        folder.mkdir()
        return namespace, folder

    def _env(self, folder: Path) -> dict[str, str]:
        env = {
            **os.environ,
            "KILN_REDIS_URL": self.redis_url,
            "KILN_S3_ENDPOINT_URL": self.endpoint,
            "KILN_S3_REGION": S3_REGION,
            "KILN_S3_ADDRESSING_STYLE": "path",
            "KILN_S3_ACCESS_KEY_ID": S3_KEY_ID,
            "KILN_S3_SECRET_ACCESS_KEY": S3_SECRET,
            "KILN_PIPELINES": json.dumps(["default", *self.args.pipelines]),
            "KILN_TEST_COMPLETIONS": str(folder / "completions.log"),
            "KILN_BENCH_FORWARDS": str(folder / "forwards.log"),
            "KILN_BENCH_TORCH_THREADS": str(self.args.threads),
            "KILN_CPU_THREADS_PER_RANK": str(self.args.threads),
            "KILN_METRICS_PORT": "0",
            "PYTHONUNBUFFERED": "1",
        }
        if self.args.small:
            env[SMOKE_ENV] = "1"
        return env

    def _specs(self) -> dict[str, str]:
        return {name: PIPELINES[name][0] for name in self.args.pipelines}

    def start_node(self, max_batch: int) -> None:
        """A `kiln worker` with one rank on the device, every pipeline resident; returns at once."""
        namespace, folder = self._namespace(f"mb{max_batch}")
        env = {
            **self._env(folder),
            "KILN_REDIS_NAMESPACE": namespace,
            "KILN_STORAGE_URL": f"s3://{namespace}/outputs",
        }
        cluster = Cluster(env=env, tmp=folder)
        worker = cluster.start_worker(
            *(f"{name}={spec}" for name, spec in self._specs().items()),
            devices=self.args.kiln_devices,
            extra_args=["--max-batch", str(max_batch), "--loglevel", "WARNING"],
            wait=False,
        )
        label = f"Kiln max-batch {max_batch}"
        self.nodes.append(Side(label, max_batch, folder, cluster=cluster, worker=worker))

    def start_baseline(self) -> None:
        """The hand-written worker with every pipeline loaded on the device; returns at once."""
        namespace, folder = self._namespace("baseline")
        process = BaselineProcess.start(
            redis_url=self.redis_url,
            namespace=namespace,
            endpoint=self.endpoint,
            bucket=namespace,
            pipelines=self._specs(),
            env=self._env(folder),
            log_path=folder / "baseline.log",
            device=self.args.device,
        )
        self.baseline = Side(BASELINE, 1, folder, baseline=process)

    def wait_ready(self) -> None:
        """Block until every node and the hand-written worker are loaded and warm."""
        for node in self.nodes:
            assert node.worker is not None
            node.worker.wait_ready(timeout_s=900)
        assert self.baseline is not None
        assert self.baseline.baseline is not None
        self.baseline.baseline.wait_ready(timeout_s=900)

    def stop(self) -> None:
        """Stop every process and delete every namespace."""
        for node in self.nodes:
            if node.cluster is not None:
                node.cluster.stop_all()
        if self.baseline is not None and self.baseline.baseline is not None:
            self.baseline.baseline.stop()
        for namespace in self.namespaces:
            with contextlib.suppress(Exception):
                delete_namespace(self.redis_url, namespace)


@contextlib.contextmanager
def services(args: argparse.Namespace, tmp: Path) -> Iterator[Services]:
    """moto, then the nodes and the hand-written worker, started side by side."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    redis_url = TEST_REDIS_URL
    found = Services(args, tmp, redis_url, f"http://{host}:{port}")
    try:
        for max_batch in args.max_batches:
            found.start_node(max_batch)
        found.start_baseline()
        started = time.monotonic()
        found.wait_ready()
        print(f"# nodes and hand-written worker ready after {time.monotonic() - started:.1f} s")
        yield found
    finally:
        found.stop()
        moto.stop()


# --- streams -----------------------------------------------------------------------------------


@dataclass
class Stream:
    """One side's share of one configuration: its stream windows and per-job figures."""

    jobs: int = 0
    wall_s: float = 0.0
    windows: list[tuple[float, float]] = field(default_factory=list)
    forward_s: float = 0.0
    peaks_mb: list[float] = field(default_factory=list)

    def per_s(self) -> float:
        """Images per second over every window."""
        return self.jobs / self.wall_s

    def forward_busy(self) -> float:
        """The share of the windows spent inside a forward."""
        return self.forward_s / self.wall_s


def job_requests(pipeline: str, size: int, steps: int, count: int, tag: str) -> list[JobRequest]:
    """`count` png jobs of `pipeline`, size x size, seeds 0.."""
    guidance = PIPELINES[pipeline][1]
    return [
        JobRequest(pipeline=pipeline, prompt=f"{tag} {i}", width=size, height=size, steps=steps,
                   seed=i, guidance_scale=guidance, output_format="png")
        for i in range(count)
    ]  # fmt: skip


def forward_time(path: Path, window: tuple[float, float]) -> float:
    """Seconds of recorded forwards inside `window`."""
    start, end = window
    spans = read_forwards(path, start - 1.0)
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b, _ in spans)


def timeout_for(requests: Sequence[JobRequest]) -> float:
    """A generous bound for a stream: 10 minutes plus 1 s per step of every job."""
    return 600.0 + sum(r.steps for r in requests)


def run_stream(side: Side, requests: list[JobRequest], into: Stream) -> None:
    """Submit every request to `side` at once; wait for all; add the figures to `into`."""
    started = time.time()
    if side.baseline is not None:
        job_ids = [secrets.token_hex(12) for _ in requests]
        for job_id, request in zip(job_ids, requests, strict=True):
            side.baseline.submit(job_id, request.model_dump(mode="json"))
        statuses = wait_baseline(side.baseline, job_ids, timeout_for(requests))
        last = max(float(s["finished_at"]) for s in statuses)
        peaks = [float(s["peak_mb"]) for s in statuses]
    else:
        assert side.cluster is not None
        job_ids = side.cluster.submit_many(requests)
        records = wait_all(side.cluster.store, job_ids, timeout_for(requests))
        last = max(float(r.finished_at or 0.0) for r in records)
        peaks = [float(r.metrics["peak_memory_mb"]) for r in records]
    window = (started, last)
    into.jobs += len(requests)
    into.wall_s += last - started
    into.windows.append(window)
    into.forward_s += forward_time(side.forwards, window)
    into.peaks_mb.extend(peaks)


def overhead_ms(side: Side, requests: list[JobRequest]) -> list[float]:
    """Per sequential job: latency minus rank 0's forward, encode_s and upload_s, in ms."""
    assert side.cluster is not None
    cluster = side.cluster
    overheads = []
    for request in requests:
        submitted = time.time()
        record, _ = cluster.intake.submit(request)
        state = wait_event(cluster.store, record.id, timeout_s=timeout_for([request]))
        latency = time.time() - submitted
        if state != "succeeded":
            raise RuntimeError(f"{side.label}: overhead job {record.id} ended {state}")
        record = cluster.store.get(record.id)
        began, ended = record.started_at or 0.0, record.finished_at or 0.0
        inside = [b - a for a, b, _ in read_forwards(side.forwards, began) if b <= ended]
        if len(inside) != 1:
            raise RuntimeError(f"{side.label}: job {record.id}: {len(inside)} forwards in it")
        own = inside[0] + float(record.metrics["encode_s"]) + float(record.metrics["upload_s"])
        overheads.append((latency - own) * 1e3)
    return overheads


# --- one configuration -------------------------------------------------------------------------


@dataclass
class Row:
    """The printed figures of one configuration (pipeline, size, max batch)."""

    pipeline: str
    size: int
    steps: int
    kiln: Stream
    base: Stream
    max_batch: int
    kiln_gpu: float | None
    base_gpu: float | None
    overhead_ms: list[float]

    def ratio(self) -> float:
        """Kiln's images/s over the hand-written worker's."""
        return self.kiln.per_s() / self.base.per_s()

    def cells(self) -> list[str]:
        """The row's cells, in `COLUMNS` order."""
        return [
            self.pipeline,
            str(self.size),
            str(self.steps),
            str(self.max_batch),
            f"{self.kiln.per_s():.3f}",
            f"{self.base.per_s():.3f}",
            f"{self.ratio():.2f}",
            percent(self.kiln_gpu),
            percent(self.base_gpu),
            percent(self.kiln.forward_busy()),
            percent(self.base.forward_busy()),
            f"{pct(self.overhead_ms, 0.5):.1f}",
            f"{max(self.kiln.peaks_mb):.0f}",
            f"{max(self.base.peaks_mb):.0f}",
        ]


def percent(value: float | None) -> str:
    """`97.3%`, or `n/a` where nothing was measured (no GPU)."""
    return "n/a" if value is None else f"{value * 100:.1f}%"


def measure_size(found: Services, pipeline: str, size: int, gpu: GpuBusy | None) -> list[Row]:
    """Warm up, run the alternating rounds and the sequential jobs for one pipeline and size."""
    args = found.args
    assert found.baseline is not None
    sides = [found.baseline, *found.nodes]
    print(f"# {pipeline} {size}x{size}: warm-up", flush=True)
    for side in sides:
        warm = job_requests(pipeline, size, 2, side.max_batch, "warm-up")
        run_stream(side, warm, Stream())
    streams = {side.label: Stream() for side in sides}
    for index in range(args.rounds):
        order = sides if index % 2 == 0 else sides[::-1]
        for side in order:
            print(f"# {pipeline} {size}x{size}: round {index + 1}, {side.label}", flush=True)
            requests = job_requests(pipeline, size, args.steps, args.jobs, f"round {index}")
            run_stream(side, requests, streams[side.label])
    base = streams[BASELINE]
    rows = []
    for node in found.nodes:
        print(f"# {pipeline} {size}x{size}: one at a time, {node.label}", flush=True)
        overheads = overhead_ms(
            node, job_requests(pipeline, size, args.steps, args.overhead_jobs, "overhead")
        )
        kiln = streams[node.label]
        rows.append(
            Row(
                pipeline, size, args.steps, kiln, base, node.max_batch,
                gpu.mean(kiln.windows) if gpu else None,
                gpu.mean(base.windows) if gpu else None,
                overheads,
            )
        )  # fmt: skip
    return rows


# --- report ------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    """The figures, one row per configuration, columns aligned."""
    table = [list(COLUMNS), *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    for line in table:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)))


def print_goals(rows: list[Row]) -> None:
    """Each configuration against the goal that applies to it."""
    print("\ngoals")
    for row in rows:
        name = f"  {row.pipeline} {row.size}² max-batch {row.max_batch}:"
        if row.kiln_gpu is None:
            busy = "GPU busy n/a (no GPU)"
        else:
            met = "met" if row.kiln_gpu >= GPU_BUSY_GOAL else "NOT met"
            busy = f"GPU busy {percent(row.kiln_gpu)} (goal >= 97%: {met})"
        if row.size == 512 and row.max_batch > 1:
            goal = BATCHED_512_GOAL
        elif row.size == 1024:
            goal = OVERLAP_1024_GOAL
        else:
            print(f"{name} {busy}; ratio {row.ratio():.2f}x (no ratio goal at this size)")
            continue
        met = "met" if row.ratio() >= goal else "NOT met"
        print(f"{name} {busy}; ratio {row.ratio():.2f}x (goal >= {goal}x: {met})")


# --- main --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; `--small` swaps in the CPU check's shapes and counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:<index>, or cpu")
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--max-batches", default="1,4", help="one Kiln node per value")
    parser.add_argument("--jobs", type=int, default=4, help="jobs per side and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--overhead-jobs", type=int, default=2, help="sequential, per node")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU process")
    parser.add_argument(
        "--small",
        action="store_true",
        help="CPU check: shrunk models (KILN_BENCH_SMOKE), 64x64, 2 steps, 4 jobs, 1 round",
    )
    args = parser.parse_args(argv)
    if args.small:
        args.device, args.sizes, args.steps = "cpu", "64", 2
        args.jobs, args.rounds, args.overhead_jobs = 4, 1, 1
    args.pipelines = [name for name in args.pipelines.split(",") if name]
    unknown = set(args.pipelines) - set(PIPELINES)
    if unknown:
        parser.error(f"--pipelines: unknown {sorted(unknown)}; known {sorted(PIPELINES)}")
    args.sizes = [int(size) for size in args.sizes.split(",")]
    args.max_batches = [int(batch) for batch in args.max_batches.split(",")]
    args.kiln_devices = "cpu:1" if args.device == "cpu" else args.device
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Start everything, measure every configuration, print the table and the goals."""
    args = parse_args(argv)
    import torch

    cuda = args.device.startswith("cuda")
    name = torch.cuda.get_device_name(args.device) if cuda else "CPU (no GPU)"
    print(f"# torch {torch.__version__}, {name}; {args.steps} steps, {args.jobs} jobs a round "
          f"per side, {args.rounds} rounds, {args.overhead_jobs} sequential jobs per node"
          + (" (--small: shrunk models)" if args.small else ""), flush=True)  # fmt: skip
    began = time.monotonic()
    gpu = GpuBusy(torch.device(args.device).index or 0) if cuda else None
    rows: list[Row] = []
    with (
        tempfile.TemporaryDirectory(prefix="kiln-bench-gpu-") as folder,
        services(args, Path(folder)) as found,
    ):
        if gpu is not None:
            gpu.start()
        try:
            for pipeline in args.pipelines:
                for size in args.sizes:
                    rows.extend(measure_size(found, pipeline, size, gpu))
        finally:
            if gpu is not None:
                gpu.stop()
    print()
    print_table(rows)
    print_goals(rows)
    print(f"\n(total {time.monotonic() - began:.0f} s)")


if __name__ == "__main__":
    main()
