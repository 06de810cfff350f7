"""Operators' view of a real stack: Prometheus metrics, JSON logs, Celery task states (Flower).

A real `kiln worker` (the sleepy fixture pipeline on one CPU rank) and a real `kiln api` (uvicorn)
run as subprocesses against a cluster namespace; the tests scrape both `/metrics`, parse every
log line, and follow the Celery task events a monitor such as Flower consumes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery
from celery.events.state import State
from prometheus_client.parser import text_string_to_metric_families

from kiln.common.states import JobState
from kiln.tasks.queue.app import transport_options
from tests.e2e.cluster import REPO_ROOT, SLEEPY, Cluster, WorkerProcess
from tests.e2e.pipelines import FAIL_PROMPT
from tests.waiting import wait_until

OBSERVED_ENV = {"KILN_LOG_FORMAT": "json", "KILN_TASK_EVENTS": "true"}
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ApiProcess:
    """`kiln api` as a subprocess (auth off), its URL and its log."""

    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_api(cluster: Cluster) -> ApiProcess:
    port = free_port()
    log_path = cluster.tmp / f"api-{port}.log"
    env = {**cluster.env, "KILN_AUTH_ENABLED": "false"}
    args = [sys.executable, "-m", "kiln.tasks.cli", "api", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    api = ApiProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kiln api exited:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{api.url}/healthz", timeout=2).status_code == 200:
                return api
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    api.stop()
    raise TimeoutError(f"kiln api did not start:\n{log_path.read_text()}")


def scrape(url: str) -> Samples:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels (node_id left out matches any); 0 when absent."""
    found = 0.0
    for (sample_name, sample_labels), sample_value in samples.items():
        if sample_name != name:
            continue
        plain = {k: v for k, v in sample_labels if k != "node_id"}
        if plain == labels:
            found += sample_value
    return found


@dataclass
class Stack:
    """One cluster with a JSON-logging, event-sending node (metrics on) and an API."""

    cluster: Cluster
    worker: WorkerProcess
    api: ApiProcess
    metrics_url: str


@pytest.fixture(scope="module")
def stack(module_cluster_factory: Callable[..., Cluster]) -> Iterator[Stack]:
    cluster = module_cluster_factory(**OBSERVED_ENV)
    port = free_port()
    worker = cluster.start_worker(f"sleepy={SLEEPY}", extra_env={"KILN_METRICS_PORT": str(port)})
    api = start_api(cluster)
    yield Stack(cluster, worker, api, f"http://127.0.0.1:{port}")
    api.stop()


def submit_over_http(api: ApiProcess, **fields: Any) -> str:
    response = httpx.post(f"{api.url}/v1/jobs", json=fields, timeout=10)
    assert response.status_code == 201, response.text
    job_id: str = response.json()["id"]
    return job_id


def test_metrics_move_after_a_job(stack: Stack) -> None:
    api_before, node_before = scrape(stack.api.url), scrape(stack.metrics_url)
    job_id = submit_over_http(stack.api, prompt="metrics", pipeline="sleepy", steps=6)
    assert stack.cluster.wait_for(job_id).state == JobState.SUCCEEDED
    api_after, node_after = scrape(stack.api.url), scrape(stack.metrics_url)

    def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # The API: the request by its route template, the submit latency, Redis read at scrape time.
    assert moved(api_before, api_after, "kiln_api_requests_total", route="/v1/jobs", status="201")
    assert moved(api_before, api_after, "kiln_api_submit_duration_seconds_count") == 1
    assert moved(api_before, api_after, "kiln_jobs", state="succeeded") == 1
    finished = {"pipeline": "sleepy", "lane": "interactive", "state": "succeeded"}
    assert moved(api_before, api_after, "kiln_jobs_finished_total", **finished) == 1
    assert value(api_after, "kiln_jobs", state="running") == 0
    assert ("kiln_queue_depth", frozenset({("queue", "interactive.sleepy")})) in api_after
    assert value(api_after, "kiln_queue_depth", queue="interactive.sleepy") == 0
    get_job = httpx.get(f"{stack.api.url}/v1/jobs/{job_id}", timeout=10)
    assert get_job.status_code == 200
    requests = value(
        scrape(stack.api.url), "kiln_api_requests_total", route="/v1/jobs/{job_id}", status="200"
    )
    assert requests >= 1

    # The node: one forward of one output, 6 steps, each stage of the attempt timed once.
    assert value(node_after, "kiln_node_jobs_running") == 0
    assert moved(node_before, node_after, "kiln_node_denoise_steps_total", pipeline="sleepy") == 6
    assert moved(node_before, node_after, "kiln_node_group_busy_seconds_total") > 0
    assert moved(node_before, node_after, "kiln_node_batch_size_count") == 1
    assert moved(node_before, node_after, "kiln_node_batch_size_sum") == 1
    for stage in ("queue", "load", "denoise", "decode", "encode", "upload"):
        count = moved(
            node_before, node_after, "kiln_node_stage_duration_seconds_count", stage=stage
        )
        assert count == 1, stage
    assert value(node_after, "kiln_node_peak_memory_bytes", device="cpu:1") > 0
    for name in ("kiln_node_lease_renewal_failures_total", "kiln_node_upload_retries_total"):
        assert value(node_after, name) == 0
    assert value(node_after, "kiln_node_ooms_total", pipeline="sleepy") == 0
    node_ids = {dict(labels).get("node_id") for (name, labels) in node_after if "kiln_" in name}
    assert node_ids == {stack.worker.node_id}


class TaskEvents:
    """Celery's task events, received from the real broker as a monitor (Flower) would."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.state: Any = State()  # Celery's stubs leave out its task table
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TaskEvents:
        self._thread.start()
        # subscribed once the worker's heartbeat arrives
        wait_until(lambda: len(self.events), timeout_s=20, what="a Celery event")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)

    def _run(self) -> None:
        with self.app.connection() as connection:
            self._receiver = self.app.events.Receiver(connection, handlers={"*": self._on_event})
            self._receiver.capture(limit=None, timeout=None, wakeup=True)

    def _on_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self.events.append(event)
            self.state.event(event)

    def task_of(self, job_id: str) -> str:
        """The task id of the (single) `run_job` message of this job."""
        with self._lock:
            found: set[str] = {
                e["uuid"]
                for e in self.events
                if e["type"] == "task-received" and job_id in str(e.get("args"))
            }
        assert len(found) == 1, found
        return found.pop()

    def of(self, task_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e.get("uuid") == task_id]

    def final(self, task_id: str, timeout_s: float = 15.0) -> str:
        """The task's state once a terminal event arrived."""

        def state() -> str | None:
            with self._lock:
                task = self.state.tasks.get(task_id)
                return None if task is None else str(task.state)

        final = wait_until(
            state,
            lambda seen: seen in ("SUCCESS", "FAILURE", "REVOKED", "RETRY"),
            timeout_s=timeout_s,
            what=f"task {task_id} final",
        )
        return str(final)


def test_task_states_tell_the_truth(stack: Stack) -> None:
    cluster = stack.cluster
    with TaskEvents(cluster.celery) as events:
        failed = cluster.submit(prompt=FAIL_PROMPT, pipeline="sleepy", steps=3)
        assert cluster.wait_for(failed).state == JobState.FAILED
        # one line, no traceback or server path: the node's log has the traceback
        assert cluster.store.get(failed).error == {
            "type": "JobFailed",
            "message": "the pipeline failed: RuntimeError: the sleepy pipeline was asked to fail",
            "retryable": False,
        }
        long = cluster.submit(prompt="long", pipeline="sleepy", steps=200)
        cluster.wait_for_step(long, 2)
        cluster.store.cancel(long)
        assert cluster.wait_for(long).state == JobState.CANCELED
        done = cluster.submit(prompt="fine", pipeline="sleepy", steps=2)
        assert cluster.wait_for(done).state == JobState.SUCCEEDED

        failed_task, long_task, done_task = map(events.task_of, (failed, long, done))
        assert events.final(failed_task) == "FAILURE"
        assert events.final(long_task) == "REVOKED"
        assert events.final(done_task) == "SUCCESS"
        failure = [e for e in events.of(failed_task) if e["type"] == "task-failed"]
        assert len(failure) == 1
        assert "the sleepy pipeline was asked to fail" in failure[0]["exception"]
        assert [e["type"] for e in events.of(long_task)][-1] == "task-revoked"

    # Each ran once: one delivery each, one attempt, and the canceled one never finished.
    for job_id, task_id in ((failed, failed_task), (long, long_task), (done, done_task)):
        types = [e["type"] for e in events.of(task_id)]
        assert types.count("task-received") == 1, types
        assert types.count("task-started") == 1, types
        assert cluster.store.get(job_id).attempts == 1
    assert cluster.completion_count(long) == 0
    assert cluster.completion_count(done) == 1
    # Acknowledged exactly once: kombu keeps unacknowledged deliveries in a hash until the ack.
    prefix = transport_options(cluster.settings, cluster.storage_settings.redis_namespace)[
        "global_keyprefix"
    ]
    wait_until(
        lambda: cluster.store.redis.hlen(f"{prefix}unacked"),
        lambda unacked: unacked == 0,
        timeout_s=5,
        what="every run_job message acknowledged",
    )


def test_every_log_line_is_json(cluster_factory: Callable[..., Cluster]) -> None:
    cluster = cluster_factory(**OBSERVED_ENV)
    worker = cluster.start_worker(f"sleepy={SLEEPY}")
    api = start_api(cluster)
    try:
        job_id = submit_over_http(api, prompt="logged", pipeline="sleepy", steps=3)
        assert cluster.wait_for(job_id).state == JobState.SUCCEEDED
    finally:
        api.stop()
        assert worker.terminate() == 0  # the shutdown's own lines are JSON too

    node_lines = [json.loads(line) for line in worker.log_path.read_text().splitlines()]
    api_lines = [json.loads(line) for line in api.log_path.read_text().splitlines()]
    for line in node_lines + api_lines:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
    assert all(line.get("node_id") == worker.node_id for line in node_lines)

    job_lines = [line for line in node_lines if line.get("job_id") == job_id]
    loggers = {line["logger"] for line in job_lines}
    assert "kiln.tasks.node.jobs" in loggers  # the node's own lines, with the attempt
    assert "celery.app.trace" in loggers  # Celery's "succeeded" line
    assert "kiln.gpu_worker.ranks.forward" in loggers  # rank 0's lines
    assert all(line["attempt"] == 1 for line in job_lines if line["logger"].endswith(".jobs"))
    assert any(line.get("rank") == 0 for line in job_lines)
    # timings are fields of the line, not a dict in its text
    (succeeded,) = [line for line in job_lines if line["message"] == f"job {job_id} succeeded"]
    timings = ("queue_s", "run_s", "encode_s", "upload_s")
    assert all(isinstance(succeeded[name], float) for name in timings), succeeded
    forward_ends = [line for line in job_lines if line["logger"].endswith(".forward")]
    assert any(line.get("steps") == 3 and "run_s" in line for line in forward_ends), forward_ends
    assert any(line["message"].startswith("worker: Warm shutdown") for line in node_lines)
    assert any(line.get("job_id") == job_id for line in api_lines)  # "job ... accepted"
    sample = [line for line in api_lines if line.get("job_id") == job_id] + job_lines
    (cluster.tmp / "one-job.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sample))
