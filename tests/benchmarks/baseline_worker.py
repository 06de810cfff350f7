"""The hand-written Celery worker Kiln must beat (FACTS.md): what a team writes without Kiln.

One task per job, doing the steps in order in one process: run the pipeline (loaded once,
in-process, on `--device`, warmed up), PNG via imageio, `put_object` via boto3, status hash in
Redis. Solo pool, `acks_late`, prefetch 1. Started by `bench_node.py` and `bench_gpu_e2e.py`:

    .venv/bin/python -m tests.benchmarks.baseline_worker --redis-url URL --namespace NS \
        --queue Q --endpoint http://127.0.0.1:PORT --bucket B --pipeline tiny=tiny \
        --pipeline busy=python:tests.benchmarks.bench_pipelines:busy [--device cuda:0]

Producers send `baseline.run_job(job_id, request)` with `send_job`; the task writes
`{ns}:baseline:job:{id}` = {state, started_at, finished_at, run_s, encode_s, upload_s, peak_mb,
key}; `peak_mb` is measured as a Kiln rank measures it (`gpu_worker.memory.PeakMemory`: CUDA peak
allocated on a GPU, else peak RSS). `{ns}:baseline:ready` is set once every pipeline is loaded
and warm.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import redis
from celery import Celery
from celery.signals import worker_ready

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK_NAME = "baseline.run_job"
S3_REGION = "us-east-1"
S3_KEY_ID = S3_SECRET = "testing"  # moto accepts any


def make_app(redis_url: str, namespace: str) -> Celery:
    """The baseline's Celery app: acks_late, prefetch 1, JSON, queues under the namespace."""
    app = Celery("baseline", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={"global_keyprefix": f"{namespace}:celery:"},
        broker_connection_retry_on_startup=True,
        worker_send_task_events=False,
    )
    return app


def job_key(namespace: str, job_id: str) -> str:
    """The status hash of one baseline job."""
    return f"{namespace}:baseline:job:{job_id}"


def ready_key(namespace: str) -> str:
    """Set once the worker has loaded and warmed up its pipelines."""
    return f"{namespace}:baseline:ready"


def send_job(app: Celery, queue: str, job_id: str, request: dict[str, Any]) -> None:
    """Publish one job to the baseline worker."""
    app.send_task(TASK_NAME, args=[job_id, request], queue=queue)


@dataclass
class BaselineProcess:
    """The producer's handle on a baseline worker subprocess."""

    process: subprocess.Popen[bytes]
    app: Celery
    redis: redis.Redis[str]
    namespace: str
    queue: str
    log_path: Path

    @classmethod
    def start(
        cls,
        *,
        redis_url: str,
        namespace: str,
        endpoint: str,
        bucket: str,
        pipelines: dict[str, str],
        env: dict[str, str],
        log_path: Path,
        device: str = "cpu",
    ) -> BaselineProcess:
        """Spawn `python -m tests.benchmarks.baseline_worker` (returns at once)."""
        queue = f"{namespace}.jobs"
        args = [
            sys.executable,
            "-m",
            "tests.benchmarks.baseline_worker",
            "--redis-url",
            redis_url,
            "--namespace",
            namespace,
            "--queue",
            queue,
            "--endpoint",
            endpoint,
            "--bucket",
            bucket,
            "--device",
            device,
        ]
        for name, spec in pipelines.items():
            args += ["--pipeline", f"{name}={spec}"]
        root = Path(__file__).resolve().parents[2]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root
            )
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        return cls(process, make_app(redis_url, namespace), client, namespace, queue, log_path)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until the worker has loaded its pipelines and consumes."""
        deadline = time.monotonic() + timeout_s
        while not self.redis.exists(ready_key(self.namespace)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"baseline worker not ready:\n{tail}")
            time.sleep(0.2)

    def submit(self, job_id: str, request: dict[str, Any]) -> None:
        """Publish one job."""
        send_job(self.app, self.queue, job_id, request)

    def statuses(self, job_ids: list[str]) -> list[dict[str, str]]:
        """The status hashes of `job_ids`, in order ({} where not written yet)."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(job_key(self.namespace, job_id))
        return list(pipe.execute())

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.redis.close()


@dataclass
class Worker:
    """What the task needs: pipelines, clients, where to write."""

    namespace: str
    bucket: str
    device: str = "cpu"
    pipelines: dict[str, Any] = field(default_factory=dict)
    s3: Any = None
    redis: Any = None


def load(worker: Worker, specs: dict[str, str], redis_url: str, endpoint: str) -> None:
    """Load every pipeline on the worker's device and warm each up with one small request."""
    import torch

    from kiln.gpu_worker.pipelines import load_pipeline
    from kiln.gpu_worker.protocol import GenerationRequest

    device = torch.device(worker.device)
    # A Kiln rank's default (GroupConfig: cores / ranks); bench_node.py loads `tiny` through
    # bench_pipelines:tiny, which then pins KILN_BENCH_TORCH_THREADS like it does on every side.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
    for name, spec in specs.items():
        pipeline = load_pipeline(spec, device)
        warm = GenerationRequest("warmup", name, "warm-up", 64, 64, 2, seed=0, guidance_scale=5.0)
        pipeline.run([warm], lambda _step, _total: None)
        worker.pipelines[name] = pipeline
    worker.s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=S3_REGION,
        aws_access_key_id=S3_KEY_ID,
        aws_secret_access_key=S3_SECRET,
    )
    worker.redis = redis.Redis.from_url(redis_url)


def run_job(worker: Worker, job_id: str, request: dict[str, Any]) -> None:
    """The steps, in order: status, pipeline, PNG, upload, status."""
    import imageio.v3 as iio
    import torch

    from kiln.gpu_worker.memory import PeakMemory
    from kiln.gpu_worker.protocol import GenerationRequest

    key = job_key(worker.namespace, job_id)
    worker.redis.hset(key, mapping={"state": "running", "started_at": time.time()})
    generation = GenerationRequest(
        request_id=job_id,
        pipeline=request["pipeline"],
        prompt=request["prompt"],
        width=int(request["width"]),
        height=int(request["height"]),
        steps=int(request["steps"]),
        seed=int(request["seed"]),
        guidance_scale=float(request["guidance_scale"]),
    )
    peak = PeakMemory(torch.device(worker.device))
    peak.reset()
    started = time.perf_counter()
    frames = worker.pipelines[generation.pipeline].run([generation], lambda _step, _total: None)
    ran = time.perf_counter()
    peak_mb = peak.measure().peak_mb
    data = iio.imwrite("<bytes>", frames[0][0][0], extension=".png")
    encoded = time.perf_counter()
    object_key = f"baseline/{job_id}/0.png"
    worker.s3.put_object(Bucket=worker.bucket, Key=object_key, Body=data, ContentType="image/png")
    uploaded = time.perf_counter()
    worker.redis.hset(
        key,
        mapping={
            "state": "succeeded",
            "finished_at": time.time(),
            "run_s": ran - started,
            "encode_s": encoded - ran,
            "upload_s": uploaded - encoded,
            "peak_mb": peak_mb,
            "key": object_key,
        },
    )


def main() -> None:
    """Parse arguments, load, serve until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--pipeline", action="append", default=[], help="NAME=SPEC")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:<index>")
    args = parser.parse_args()
    specs = dict(item.split("=", 1) for item in args.pipeline)
    worker = Worker(args.namespace, args.bucket, args.device)
    load(worker, specs, args.redis_url, args.endpoint)
    app = make_app(args.redis_url, args.namespace)

    @app.task(name=TASK_NAME, ignore_result=True, acks_late=True)
    def baseline_run_job(job_id: str, request: dict[str, Any]) -> None:
        run_job(worker, job_id, request)

    def on_ready(**_: Any) -> None:
        worker.redis.set(ready_key(args.namespace), str(os.getpid()))

    worker_ready.connect(on_ready, weak=False)
    app.worker_main(
        [
            "worker",
            "--pool=solo",
            "--concurrency=1",
            "--prefetch-multiplier=1",
            f"--queues={args.queue}",
            "--hostname=baseline@%h",
            "--loglevel=WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
    )


if __name__ == "__main__":
    main()
