"""Real node workers as subprocesses, for end-to-end and crash tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

from kiln.common.states import TERMINAL_STATES
from kiln.storage.job_store import JobRecord, JobStore
from kiln.storage.objects import ObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.process import ProcessParts
from tests.tasks.helpers import write_many
from tests.waiting import wait_for_changes, wait_until

SLEEPY = "python:tests.e2e.pipelines:sleepy"
REPO_ROOT = Path(__file__).resolve().parents[2]


def child_pids(pid: int) -> list[int]:
    """Direct children of a process, from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            children.append(int(entry.name))
    return children


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def process_cpu_s(pid: int) -> float:
    """CPU seconds one process used so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class WorkerProcess:
    """One `kiln worker` subprocess."""

    process: subprocess.Popen[bytes]
    node_id: str
    log_path: Path
    store: JobStore

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the node's heartbeat appears (its group is up and warm)."""

        def heartbeat() -> dict[str, Any] | None:
            assert self.process.poll() is None, f"worker {self.node_id} exited early"
            return self.heartbeat()

        try:
            wait_until(heartbeat, timeout_s=timeout_s, poll_s=0.2, what=f"{self.node_id} ready")
        except AssertionError as failed:
            raise AssertionError(f"{failed}\n{self.log()}") from None

    def heartbeat(self) -> dict[str, Any] | None:
        """The node's live heartbeat (what it published last), or None."""
        return next((n for n in self.store.live_nodes() if n["node_id"] == self.node_id), None)

    def heartbeats(self, count: int = 2) -> dict[str, Any]:
        """Wait for `count` heartbeats written after this call; what the last one published.

        The positive signal for "nothing happens" checks: the node was up and ran its loops
        (controls poll, audits) while the test looked, however slow the machine.
        """
        nodes_key = self.store.keys.nodes  # node id -> heartbeat deadline, moved on each beat
        wait_for_changes(
            lambda: self.store.redis.zscore(nodes_key, self.node_id),
            count,
            what=f"{count} heartbeats of {self.node_id}",
        )
        info = self.heartbeat()
        assert info is not None, f"{self.node_id}'s heartbeat lapsed:\n{self.log()}"
        return info

    def log(self) -> str:
        """The worker's output so far (tail: for a failure's message)."""
        return self.output()[-6000:]

    def output(self) -> str:
        """The worker's whole output so far: what a test searches for a line."""
        return self.log_path.read_text(errors="replace")

    def rank_pids(self) -> dict[int, int]:
        """Rank → pid of the group's live rank processes (found by their process titles)."""
        ranks = {}
        # the node's children when spawned, its rank server's when forked (gpu_worker/rank_server)
        children = child_pids(self.process.pid)
        for pid in [*children, *(pid for child in children for pid in child_pids(child))]:
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            match = re.search(r"kiln-gpu-worker\[.*\] rank (\d+)/", title)
            if match and alive(pid):
                ranks[int(match.group(1))] = pid
        return ranks

    def kill9(self) -> None:
        """SIGKILL the worker's main process (its ranks die with it)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and wait for the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        """Stop by any means (teardown)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Cluster:
    """A namespace in a real Redis plus an object store, and the workers started on them."""

    env: dict[str, str]
    tmp: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Settings classes read os.environ: build them from the cluster's environment instead.
        with patch.dict(os.environ, self.env, clear=True):
            self.storage_settings = StorageSettings()
            self.settings = KilnSettings()
        # the process's parts as `kiln submit` without --api builds them
        parts = ProcessParts(self.settings, self.storage_settings)
        self.store = parts.store
        self.objects: ObjectStore = parts.objects
        self.celery = parts.celery_app
        self.submitter = parts.submitter
        # the one way in (tasks/intake), as `kiln submit` without --api uses it
        self.intake = Intake(self.submitter, self.objects)
        self.completions = Path(self.env["KILN_TEST_COMPLETIONS"])

    def start_worker(
        self,
        *pipelines: str,
        devices: str = "cpu:1",
        extra_env: dict[str, str] | None = None,
        extra_args: Iterable[str] = (),
        wait: bool = True,
        cwd: Path = REPO_ROOT,
    ) -> WorkerProcess:
        """Start `kiln worker` serving `pipelines` (NAME or NAME=SPEC).

        `cwd`: the tree whose `kiln` it runs (a checkout of another commit, for a benchmark).
        """
        node_id = f"node-{uuid.uuid4().hex[:8]}"
        args = [
            sys.executable,
            "-m",
            "kiln.tasks.cli",
            "worker",
            "--devices",
            devices,
            "--node-id",
            node_id,
            "--max-batch",
            "4",
            *extra_args,
        ]
        for pipeline in pipelines:
            args += ["--pipeline", pipeline]
        log_path = self.tmp / f"{node_id}.log"
        env = {**self.env, **(extra_env or {})}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
        worker = WorkerProcess(process, node_id, log_path, self.store)
        self.workers.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def submit(self, **fields: object) -> str:
        """Submit a job through the intake (`tasks.intake`); returns its id."""
        record, _ = self.intake.submit(JobRequest.model_validate(fields))
        return record.id

    def submit_many(self, requests: list[JobRequest]) -> list[str]:
        """Jobs the intake accepted, written in one pipelined step (as a feeder writes a chunk)."""
        return write_many(self.intake, requests)

    def run_cli(self, *args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess[str]:
        """Run `kiln ARGS...` as a user would, against this cluster; capture its output."""
        return subprocess.run(
            [sys.executable, "-m", "kiln.tasks.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def wait_for(
        self, job_id: str, timeout_s: float = 60.0, states: Iterable[str] = ()
    ) -> JobRecord:
        """Poll until the job reaches one of `states` (default: any terminal state)."""
        wanted = {str(s) for s in states} or {str(s) for s in TERMINAL_STATES}
        try:
            return wait_until(
                lambda: self.store.get(job_id),
                lambda record: str(record.state) in wanted,
                timeout_s=timeout_s,
                what=f"job {job_id} {sorted(wanted)}",
            )
        except AssertionError as failed:
            logs = "\n".join(w.log() for w in self.workers)
            raise AssertionError(f"{failed}\n{logs}") from None

    def wait_for_step(self, job_id: str, step: int, timeout_s: float = 60.0) -> None:
        """Poll until the job reports at least `step` denoising steps."""
        wait_until(
            lambda: self.store.get(job_id).progress or {},
            lambda progress: (
                progress.get("stage") == "denoising" and int(progress.get("step", 0)) >= step
            ),
            timeout_s=timeout_s,
            poll_s=0.02,
            what=f"job {job_id} at step {step}",
        )

    def completion_count(self, job_id: str) -> int:
        """How many times a sleepy pipeline finished this job."""
        if not self.completions.exists():
            return 0
        return self.completions.read_text().split().count(job_id)

    def list_output_keys(self, job_id: str) -> list[str]:
        """Every object under the job's folder, listed from the bucket or directory itself."""
        settings = self.storage_settings
        prefix = self.objects.prefix
        folder = f"{prefix}/{job_id}/" if prefix else f"{job_id}/"
        if settings.storage_url.startswith("file://"):
            root = Path(settings.storage_url.removeprefix("file://"))
            return sorted(
                str(p.relative_to(root))
                for p in (root / folder).rglob("*")  # each attempt writes a folder of its own
                if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".meta.json")
            )
        import boto3

        bucket = settings.storage_url.removeprefix("s3://").split("/", 1)[0]
        secret = settings.s3_secret_access_key
        client = boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            region_name=settings.s3_region,
            aws_access_key_id=settings.s3_access_key_id,
            aws_secret_access_key=secret.get_secret_value() if secret else None,
        )
        listing = client.list_objects_v2(Bucket=bucket, Prefix=folder)
        return sorted(item["Key"] for item in listing.get("Contents", []))

    def stop_all(self) -> None:
        """Stop every worker this cluster started."""
        for worker in self.workers:
            worker.stop()
