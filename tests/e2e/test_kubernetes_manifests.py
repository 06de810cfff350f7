"""deploy/kubernetes/'s cpu-demo overlay run as local processes: a job through its API Service.

Each pod of the rendered overlay runs its container's own command line and the environment the
kubelet would build (tests/e2e/kubernetes_pods.py): the ConfigMap, the Secret written from
kiln-secrets.env.example, the pod name from the downward API, Service links unless turned off.
The Redis StatefulSet's command runs as a private redis-server (password, AOF, noeviction);
moto's S3 server stands in for MinIO. Readiness is each pod's own readiness probe command. A job
goes in through the kiln-api Service's port, the node's liveness probe fails while its process is
frozen and passes again after, SIGTERM drains the node with a job running (no preStop hook), and
every pod exits 0 on SIGTERM.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import boto3
import httpx
import pytest

from kiln.storage.s3_store import parse_s3_url
from kiln.tasks.cli.embedded import free_port, wait_for_port
from tests.deploy.kustomize import KUBERNETES_DIR, OVERLAYS, by_kind, render
from tests.e2e.compose_stack import (
    DOCKERFILE,
    ServiceProcess,
    dockerfile_targets,
    host_environment,
    read_env_file,
)
from tests.e2e.kubernetes_pods import Cluster, PodLocalizer
from tests.waiting import wait_until

SECRETS_EXAMPLE = KUBERNETES_DIR / "kiln-secrets.env.example"
NODE = "kiln-node-default"
NODE_POD = "kiln-node-default-5d8f7c9b4-x2x7q"
FINAL = {"succeeded", "failed", "canceled", "expired"}


def filled_secrets(redis_password: str) -> dict[str, str]:
    """kiln-secrets.env.example with every empty value filled in, as an operator writes it."""
    made = {
        "KILN_REDIS_URL": f"redis://:{redis_password}@kiln-redis:6379/0",
        "KILN_WEBHOOK_SECRET": "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode(),
        "HF_TOKEN": "",
    }
    example = read_env_file(SECRETS_EXAMPLE)
    return {key: value or made.get(key, secrets.token_hex(16)) for key, value in example.items()}


@dataclass
class Stack:
    """The overlay's pods running here."""

    cluster: Cluster
    pods: dict[str, ServiceProcess]
    api_key: str

    @property
    def api_url(self) -> str:
        """The kiln-api Service: its port → the pod's named port → where `kiln api` listens."""
        service = by_kind(self.cluster.resources, "Service")["kiln-api"]
        (port,) = service["spec"]["ports"]
        container = self.cluster.workload("kiln-api")["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[port["targetPort"]] == 8000  # `kiln api`'s default port, which it serves
        return f"http://127.0.0.1:{self.pods['kiln-api'].port('KILN_API_PORT')}"

    def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.request(method, self.api_url + path, headers=headers, timeout=10, **kwargs)

    def submit(self, **fields: Any) -> str:
        response = self.call("POST", "/v1/jobs", json=fields)
        assert response.status_code == 201, response.text
        job_id: str = response.json()["id"]
        return job_id

    def wait_for(self, job_id: str, states: set[str], timeout_s: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            view: dict[str, Any] = self.call("GET", f"/v1/jobs/{job_id}").json()
            if view["status"] in states:
                return view
            assert time.monotonic() < deadline, f"job {job_id} still {view['status']}"
            time.sleep(0.1)


def wait_ready(pod: ServiceProcess, timeout_s: float = 300) -> None:
    """Until the pod's own readiness probe command passes."""
    deadline = time.monotonic() + timeout_s
    while not pod.healthy():
        assert pod.process.poll() is None, f"{pod.name} exited:\n{pod.log()}"
        assert time.monotonic() < deadline, f"{pod.name} not ready:\n{pod.log()}"
        time.sleep(1.0)


@pytest.fixture(scope="module")
def stack(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    folder = tmp_path_factory.mktemp("kubernetes")
    moto_port = urlparse(s3_server).port
    redis_port = free_port()
    resources = render(OVERLAYS["cpu-demo"])
    localizer = PodLocalizer(
        addresses={
            "kiln-redis:6379": f"127.0.0.1:{redis_port}",
            "kiln-minio:9000": f"127.0.0.1:{moto_port}",
            # the public endpoint users reach MinIO by (port-forward): another name for moto
            "localhost:9000": f"localhost:{moto_port}",
        },
        volumes={},
    )
    cluster = Cluster(
        resources,
        {"kiln-secrets": filled_secrets(secrets.token_hex(12))},
        {tag: target for tag, target in dockerfile_targets(DOCKERFILE.read_text()).items()},
        localizer,
        folder,
        host_environment(),
    )
    for workload in ("kiln-redis", "kiln-api", "kiln-webhooks", "kiln-control", NODE):
        localizer.volumes.update(cluster.volumes_of(workload))
    local_redis = ["--port", str(redis_port), "--bind", "127.0.0.1"]
    pods = {"kiln-redis": cluster.launch("kiln-redis", "kiln-redis-0", local_redis)}
    try:
        wait_for_port(redis_port, 10)
        pods["kiln-api"] = cluster.launch("kiln-api", "kiln-api-6b7d9f8c5-q4w2e")
        pods["kiln-webhooks"] = cluster.launch("kiln-webhooks", "kiln-webhooks-7f6c5d4b3-p9r8s")
        pods["kiln-control"] = cluster.launch("kiln-control", "kiln-control-5d8f7c6b9-x2k4m")
        pods[NODE] = cluster.launch(NODE, NODE_POD)
        api_key = create_bucket_and_key(cluster)
        kiln_pods = [pod for name, pod in pods.items() if name != "kiln-redis"]
        with ThreadPoolExecutor(len(kiln_pods)) as checks:
            list(checks.map(wait_ready, kiln_pods))
        yield Stack(cluster, pods, api_key)
    finally:
        for pod in reversed(pods.values()):
            pod.stop()


def create_bucket_and_key(cluster: Cluster) -> str:
    """What the kiln-minio-bucket Job and `kubectl exec deploy/kiln-api -- kiln keys create` do."""
    command = ["kiln", "keys", "create", "k8s-test", "--json"]
    keys = cluster.launch("kiln-api", "keys-create", exec_argv=command)
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


def test_every_pod_runs_its_manifest_command(stack: Stack) -> None:
    node = stack.pods[NODE]
    # The node id came from the pod's name through the downward API and `$(POD_NAME)`.
    assert node.argv[node.argv.index("--node-id") + 1] == NODE_POD
    live = stack.call("GET", "/v1/nodes").json()
    assert NODE_POD in json.dumps(live)
    # Redis took the password of KILN_REDIS_URL: without it, no answer.
    redis_port = urlparse(node.env["KILN_REDIS_URL"]).port
    anonymous = subprocess.run(
        ["redis-cli", "-p", str(redis_port), "ping"], capture_output=True, text=True, check=False
    )
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr


def test_a_job_goes_through_the_api_service_and_the_node(stack: Stack) -> None:
    job_id = stack.submit(prompt="kubernetes", steps=2, width=64, height=64)
    view = stack.wait_for(job_id, FINAL)
    assert view["status"] == "succeeded", view
    (output,) = view["outputs"]
    public = stack.pods["kiln-api"].env["KILN_S3_PUBLIC_ENDPOINT_URL"]
    assert output["url"].startswith(public + "/"), output["url"]
    download = httpx.get(output["url"], timeout=10)
    assert download.status_code == 200
    assert hashlib.sha256(download.content).hexdigest() == output["sha256"]


def liveness(stack: Stack, workload: str) -> int:
    """The exit code of the workload's liveness probe command, run in its pod's environment."""
    pod = stack.pods[workload]
    container = stack.cluster.workload(workload)["spec"]["template"]["spec"]["containers"][0]
    probe = container["livenessProbe"]
    argv = stack.cluster.localizer.argv(probe["exec"]["command"])
    done = subprocess.run(
        argv, env=pod.env, capture_output=True, timeout=probe["timeoutSeconds"], check=False
    )
    return done.returncode


def test_a_frozen_node_fails_its_liveness_probe(stack: Stack) -> None:
    """SIGSTOP: the process is there and does nothing, as a wedged node; SIGCONT: it lives again.

    Redis answers throughout: the node's own heartbeat, not Redis, decides.
    """
    node = stack.pods[NODE]
    assert liveness(stack, NODE) == 0
    node.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: liveness(stack, NODE), lambda code: code == 1, what="liveness fails")
    finally:
        node.process.send_signal(signal.SIGCONT)
    wait_until(lambda: liveness(stack, NODE), lambda code: code == 0, what="liveness passes")
    job_id = stack.submit(prompt="after a freeze", steps=2, width=64, height=64)
    assert stack.wait_for(job_id, FINAL)["status"] == "succeeded"


def test_sigterm_drains_the_node_and_it_exits_0(stack: Stack) -> None:
    """The kubelet's SIGTERM, no preStop hook: a running image job finishes and the node exits 0.

    An image job takes no step checkpoints: it gets KILN_DRAIN_GRACE_S to finish, not handed back.
    """
    job_id = stack.submit(prompt="long", steps=40, width=64, height=64)
    stack.wait_for(job_id, {"running"})
    node = stack.pods[NODE]
    container = stack.cluster.workload(NODE)["spec"]["template"]["spec"]["containers"][0]
    assert "lifecycle" not in container  # SIGTERM itself is the drain (docs/operations.md §4)
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(120) == 0, node.log()
    # The only node is gone: a job it had handed back would stay queued. It finished there.
    view = stack.call("GET", f"/v1/jobs/{job_id}").json()
    assert view["status"] == "succeeded", view


def test_every_pod_exits_0_on_sigterm(stack: Stack) -> None:
    """Last: the kubelet's SIGTERM, once per pod, Redis last."""
    pods = [pod for name, pod in stack.pods.items() if name not in ("kiln-redis", NODE)]
    for pod in pods:
        pod.process.send_signal(signal.SIGTERM)
    codes = {pod.name: pod.process.wait(60) for pod in pods}
    codes["kiln-redis-0"] = stack.pods["kiln-redis"].terminate()
    # uvicorn re-raises the SIGTERM it handled; as a container's PID 1 `kiln api` then exits 0.
    api = stack.pods["kiln-api"]
    if codes[api.name] == -signal.SIGTERM and "Finished server process" in api.log():
        codes[api.name] = 0
    logs = {name: pod.log()[-1500:] for name, pod in stack.pods.items()}
    assert codes == dict.fromkeys(codes, 0), logs
