"""docker-compose.yml run as local processes: a job through its API, nodes, Flower and storage.

Containers cannot run here, so each Kiln service of the compose file runs as a local process with
the compose file's (or its Dockerfile target's) own command line and environment, host names
mapped to 127.0.0.1 (tests/e2e/compose_stack.py). The compose Redis command runs as a private
redis-server; moto's S3 server stands in for MinIO and answers to its public name as well.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import boto3
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.storage.s3_store import parse_s3_url
from kiln.tasks.cli.embedded import free_port, wait_for_port
from tests.e2e.compose_stack import (
    DOCKERFILE,
    ENV_EXAMPLE,
    ComposeServices,
    Localizer,
    ServiceProcess,
    dockerfile_targets,
    host_environment,
    load_compose,
    read_env_file,
)
from tests.e2e.pipelines import FAIL_PROMPT

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kiln-dashboard.json"
SLEEPY_SPEC = "python:tests.e2e.pipelines:sleepy"
SAME_AS_FIRST_NODE = ("worker-gpu1",)


def filled_env_file(folder: Path) -> Path:
    """deploy/kiln.env.example with every empty value filled in, as an operator writes it once."""
    secret_makers: dict[str, Callable[[], str]] = {
        "KILN_WEBHOOK_SECRET": lambda: (
            "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        ),
        "FLOWER_BASIC_AUTH": lambda: "admin:" + secrets.token_hex(8),
    }
    lines = []
    for key, value in read_env_file(ENV_EXAMPLE).items():
        made = value or secret_makers.get(key, lambda: secrets.token_hex(16))()
        lines.append(f"{key}={made}")
    path = folder / "kiln.env"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class ComposeStack:
    """The compose services that run here, and what the test needs to reach them."""

    compose: ComposeServices
    running: dict[str, ServiceProcess]
    api_key: str
    public_s3: str

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.running['api'].port('KILN_API_PORT')}"

    @property
    def flower_url(self) -> str:
        return f"http://127.0.0.1:{self.running['flower'].port('FLOWER_PORT')}"

    def nodes(self) -> list[ServiceProcess]:
        return [s for name, s in self.running.items() if name.startswith("worker-")]

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.request(method, self.api_url + path, headers=headers, timeout=10, **kwargs)

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.call("GET", f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        view: dict[str, Any] = response.json()
        return view

    def submit(self, **fields: Any) -> str:
        response = self.call("POST", "/v1/jobs", json=fields)
        assert response.status_code == 201, response.text
        job_id: str = response.json()["id"]
        return job_id

    def wait_for(self, job_id: str, states: set[str], timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (view := self.job(job_id))["status"] not in states:
            assert time.monotonic() < deadline, f"job {job_id} still {view['status']}"
            time.sleep(0.1)
        return view


def wait_healthy(service: ServiceProcess, timeout_s: float = 120) -> None:
    """Until the service's own compose healthcheck passes."""
    deadline = time.monotonic() + timeout_s
    while not service.healthy():
        assert service.process.poll() is None, f"{service.name} exited:\n{service.log()}"
        assert time.monotonic() < deadline, f"{service.name} unhealthy:\n{service.log()}"
        time.sleep(1.0)  # each check is a Python process of its own: not too many at once


@pytest.fixture(scope="module")
def compose_stack(
    s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ComposeStack]:
    folder = tmp_path_factory.mktemp("compose")
    moto_port = urlparse(s3_server).port
    public_s3 = f"http://localhost:{moto_port}"  # another name for moto, as MinIO's published one
    variables = {
        "DEPLOY_ENV_FILE": str(filled_env_file(folder)),
        "DEPLOY_NODE_PREFIX": "compose-test",
        "DEPLOY_PIPELINE": SLEEPY_SPEC,
        "DEPLOY_S3_PUBLIC_URL": public_s3,
    }
    redis_port = free_port()
    localizer = Localizer(
        addresses={"redis:6379": f"127.0.0.1:{redis_port}", "minio:9000": f"127.0.0.1:{moto_port}"},
        volumes={"/models": folder / "models"},
    )
    compose = ComposeServices(
        load_compose(variables),
        dockerfile_targets(DOCKERFILE.read_text()),
        localizer,
        folder,
        host_environment(),
    )
    local_redis = ["--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(folder)]
    running = {"redis": compose.launch_image("redis", local_redis)}
    try:
        wait_for_port(redis_port, 10)
        # One node of the file's GPU nodes: the others differ only in their --node-id and GPU.
        started = [n for n in compose.kiln_services() if n not in SAME_AS_FIRST_NODE]
        running.update((name, compose.launch(name)) for name in started)
        api_key = create_bucket_and_key(compose)  # while the services start
        with ThreadPoolExecutor(len(running)) as checks:
            list(checks.map(wait_healthy, running.values()))
        yield ComposeStack(compose, running, api_key, public_s3)
    finally:
        for service in reversed(running.values()):
            service.stop()


def create_bucket_and_key(compose: ComposeServices) -> str:
    """What `minio-bucket` and `docker compose run --rm api keys create ...` do; the key."""
    keys = compose.launch("api", ["keys", "create", "compose-test", "--json"])
    assert keys.process.wait(60) == 0, keys.log()
    env = keys.env
    bucket, _ = parse_s3_url(env["KILN_STORAGE_URL"])
    boto3.client(
        "s3",
        endpoint_url=env["KILN_S3_ENDPOINT_URL"],
        region_name=env["KILN_S3_REGION"],
        aws_access_key_id=env["KILN_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["KILN_S3_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket=bucket)
    secret: str = json.loads(keys.log_path.read_text().splitlines()[-1])["key"]
    return secret


def scrape(url: str) -> set[str]:
    """Every metric name a /metrics page exports, with the names of a family's samples."""
    names = set()
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names.update(family.name + suffix for suffix in suffixes.get(family.type, []))
    return names


def test_every_kiln_service_runs_from_the_compose_file(compose_stack: ComposeStack) -> None:
    compose, running = compose_stack.compose, compose_stack.running
    assert set(compose.kiln_services()) == {*running, *SAME_AS_FIRST_NODE} - {"redis"}
    (node,) = compose_stack.nodes()
    assert node.env["KILN_MODEL_CACHE"] == str(compose.folder / "models" / "kiln")
    assert "cpu" in node.argv
    assert "cuda:0" not in node.argv
    # The cluster's loops run in `control` alone (`kiln control`), none in the GPU nodes.
    assert node.env["KILN_NODE_CONTROL_LOOPS"] == "false"
    assert compose_stack.running["control"].argv[-1] == "control"
    assert "KILN_NODE_CONTROL_LOOPS" not in compose_stack.running["control"].env
    # The node left out runs the same command line but for its own id.
    other = compose.services["worker-gpu1"]
    assert other["command"] == [
        arg.replace("gpu0", "gpu1") for arg in compose.services["worker-gpu0"]["command"]
    ]
    assert other["healthcheck"]["test"][-1].endswith("-gpu1")
    assert other["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["1"]


def test_a_job_goes_through_the_api_a_node_and_the_public_storage_url(
    compose_stack: ComposeStack,
) -> None:
    job_id = compose_stack.submit(prompt="compose", steps=3, width=64, height=64)
    view = compose_stack.wait_for(job_id, {"succeeded", "failed", "canceled", "expired"})
    assert view["status"] == "succeeded", view
    (output,) = view["outputs"]
    # Signed for the store's public name, not the address the services use.
    assert output["url"].startswith(compose_stack.public_s3 + "/"), output["url"]
    download = httpx.get(output["url"], timeout=10)
    assert download.status_code == 200
    assert hashlib.sha256(download.content).hexdigest() == output["sha256"]

    api_metrics = httpx.get(compose_stack.api_url + "/metrics", timeout=10).text
    assert re.search(r'kiln_api_requests_total\{[^}]*route="/v1/jobs"[^}]*\} 1\.0', api_metrics)
    (node,) = compose_stack.nodes()
    page = httpx.get(f"http://127.0.0.1:{node.port('KILN_METRICS_PORT')}/metrics", timeout=10)
    found = re.findall(r"kiln_node_denoise_steps_total\{[^}]*\} (\S+)", page.text)
    assert sum(float(value) for value in found) == 3


def test_the_dashboard_queries_only_exported_metrics(compose_stack: ComposeStack) -> None:
    node = compose_stack.nodes()[0]
    exported = scrape(compose_stack.api_url + "/metrics") | scrape(
        f"http://127.0.0.1:{node.port('KILN_METRICS_PORT')}/metrics"
    )
    queried = set(re.findall(r"\bkiln_[a-z_]+", DASHBOARD.read_text()))
    assert len(queried) >= 10
    assert queried - exported == set()


def flower_tasks(stack: ComposeStack, job_ids: set[str]) -> dict[str, dict[str, Any]]:
    """Flower's view of the `run_job` tasks of these jobs (by job id), once each is final."""
    user, _, password = stack.running["flower"].env["FLOWER_BASIC_AUTH"].partition(":")
    deadline = time.monotonic() + 20
    while True:
        answer = httpx.get(f"{stack.flower_url}/api/tasks", auth=(user, password), timeout=10)
        assert answer.status_code == 200, answer.text
        found = {
            job_id: task
            for task in answer.json().values()
            for job_id in job_ids
            if job_id in str(task.get("args"))
        }
        states = {task.get("state") for task in found.values()}
        if found.keys() == job_ids and states <= {"SUCCESS", "FAILURE", "REVOKED"}:
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.3)


def test_flower_shows_a_failed_job_as_failure_and_a_canceled_one_as_revoked(
    compose_stack: ComposeStack,
) -> None:
    failed = compose_stack.submit(prompt=FAIL_PROMPT, steps=2, width=64, height=64)
    assert compose_stack.wait_for(failed, {"failed"})["status"] == "failed"
    long = compose_stack.submit(prompt="long", steps=200, width=64, height=64)
    compose_stack.wait_for(long, {"running"})
    assert compose_stack.call("POST", f"/v1/jobs/{long}/cancel").status_code == 200
    compose_stack.wait_for(long, {"canceled"})

    tasks = flower_tasks(compose_stack, {failed, long})
    assert tasks[failed]["state"] == "FAILURE"
    assert "the sleepy pipeline was asked to fail" in tasks[failed]["exception"]
    assert tasks[long]["state"] == "REVOKED"
    assert {task["name"] for task in tasks.values()} == {"kiln.run_job"}


def test_every_service_drains_on_sigterm(compose_stack: ComposeStack) -> None:
    """Last: stops the stack as `docker compose stop` would (Redis last); each exits 0."""
    services = [s for name, s in compose_stack.running.items() if name != "redis"]
    for service in services:
        service.process.send_signal(signal.SIGTERM)
    # Once each, as Docker does: a second SIGTERM cuts a Celery worker's warm shutdown short.
    codes = {service.name: service.process.wait(60) for service in services}
    codes["redis"] = compose_stack.running["redis"].terminate()
    # uvicorn re-raises the SIGTERM it handled once shut down; as a container's PID 1, where a
    # signal without a handler does nothing, `kiln api` then exits 0.
    api_log = compose_stack.running["api"].log()
    if codes["api"] == -signal.SIGTERM and "Finished server process" in api_log:
        codes["api"] = 0
    logs = {name: service.log()[-1500:] for name, service in compose_stack.running.items()}
    assert codes == dict.fromkeys(codes, 0), logs
