"""`kiln api --workers 2`: one port served by two real API processes under the supervisor.

Which child served a request is seen through the metrics' own per-process files: in multiprocess
mode prometheus_client writes `counter_<pid>.db` in PROMETHEUS_MULTIPROC_DIR once that process
counted a request.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.storage.settings import StorageSettings
from kiln.tasks.api.supervisor import stop_with_parent
from kiln.tasks.cli.embedded import free_port, wait_for_port
from tests.waiting import wait_until

BODY = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 1}


@dataclass
class WorkersApi:
    """The supervisor process and where it serves."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def children(self) -> set[int]:
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return {int(pid) for pid in path.read_text().split()}

    def metrics_dir(self) -> Path:
        """The children's PROMETHEUS_MULTIPROC_DIR, read from one child's environment."""
        child = min(self.children())
        entries = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        env = dict(e.decode().split("=", 1) for e in entries if b"=" in e)
        return Path(env["PROMETHEUS_MULTIPROC_DIR"])


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "State:\tZ" not in Path(
        f"/proc/{pid}/status"
    ).read_text(errors="replace")


@pytest.fixture
def start_api(
    storage_settings: StorageSettings, tmp_path: Path
) -> Iterator[Callable[..., WorkersApi]]:
    started: list[WorkersApi] = []

    def start(*args: str, **env: str) -> WorkersApi:
        port = free_port()
        environ = {
            **os.environ,
            "KILN_REDIS_URL": storage_settings.redis_url,
            "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
            "KILN_AUTH_ENABLED": "false",
            **env,
        }
        command = [sys.executable, "-m", "kiln.tasks.cli", "api", "--port", str(port), *args]
        with (tmp_path / f"api-{port}.log").open("wb") as log:
            process = subprocess.Popen(command, env=environ, stdout=log, stderr=log)
        api = WorkersApi(process, port)
        started.append(api)
        wait_for_port(port, timeout_s=60)
        wait_until(api.children, lambda children: len(children) == 2, timeout_s=30)
        return api

    yield start
    for api in started:
        if api.process.poll() is None:
            leftovers = api.children()
            api.process.send_signal(signal.SIGTERM)
            api.process.wait(timeout=30)
            for pid in leftovers:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def submit(url: str, count: int) -> None:
    """`count` jobs, each on a new connection."""
    for _ in range(count):
        httpx.post(f"{url}/v1/jobs", json=BODY, timeout=30).raise_for_status()


def submitted_count(url: str) -> float:
    """`kiln_api_requests_total` for 201 answers to POST /v1/jobs, as one scrape reports it."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "kiln_api_requests_total" and labels == {
                "route": "/v1/jobs",
                "status": "201",
            }:
                return sample.value
    return 0.0


def served_by(api: WorkersApi) -> set[int]:
    """The children that counted at least one request."""
    files = api.metrics_dir().glob("counter_*.db")
    return {int(f.stem.removeprefix("counter_")) for f in files} & api.children()


def test_requests_reach_both_children_and_metrics_sum_them(
    start_api: Callable[..., WorkersApi],
) -> None:
    api = start_api("--workers", "2")
    children = api.children()
    sent = 0
    with ThreadPoolExecutor(8) as pool:
        while served_by(api) != children and sent < 800:
            list(pool.map(lambda _: submit(api.url, 5), range(8)))
            sent += 40
    assert served_by(api) == children
    # every scrape, whichever child answers it, counts every child's requests
    for _ in range(6):
        assert submitted_count(api.url) == sent


def test_killed_child_is_replaced_and_sigterm_stops_everything(
    start_api: Callable[..., WorkersApi],
) -> None:
    api = start_api(KILN_API_WORKERS="2")
    submit(api.url, 10)
    metrics_dir = api.metrics_dir()
    children = api.children()
    victim = min(children)
    os.kill(victim, signal.SIGKILL)
    # the API answers meanwhile: the other child, or the replacement for connections the kernel
    # gave the dead child's socket (which waits for it)
    submit(api.url, 10)
    wait_until(lambda: api.children() - {victim}, lambda others: len(others) == 2, timeout_s=30)
    replacement = api.children() - children
    assert len(replacement) == 1
    submit(api.url, 10)
    # the killed child's counts stay in the sum
    assert submitted_count(api.url) == 30

    children = api.children()
    api.process.send_signal(signal.SIGTERM)
    assert api.process.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in children)
    assert not metrics_dir.exists()


def test_children_stop_when_the_supervisor_is_killed(
    start_api: Callable[..., WorkersApi],
) -> None:
    api = start_api("--workers", "2")
    children = api.children()
    api.process.kill()
    api.process.wait(timeout=30)
    wait_until(lambda: {pid for pid in children if alive(pid)}, lambda left: not left, timeout_s=30)


def test_a_child_whose_supervisor_died_before_it_asked_leaves_at_once() -> None:
    # The window the kernel's parent-death signal cannot cover: the supervisor gone between the
    # fork and the child's request. A parent other than the supervisor stands for that here.
    not_the_parent = os.getppid()  # this test's parent: never the child's
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=lambda: stop_with_parent(not_the_parent),
    )
    assert child.wait(timeout=30) == 0


def test_a_child_of_a_live_supervisor_keeps_running() -> None:
    supervisor = os.getpid()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        preexec_fn=lambda: stop_with_parent(supervisor),
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=1)
    finally:
        child.kill()
        child.wait()
