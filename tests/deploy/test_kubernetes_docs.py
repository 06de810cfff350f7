"""docs/kubernetes.md's instructions name what the manifests and the settings really have."""

from __future__ import annotations

import re

import yaml

from kiln.settings_check import check_environment
from kiln.storage.settings import StorageSettings
from tests.deploy.kustomize import OVERLAYS, REPO_ROOT, by_kind, iter_containers, render

DOC = REPO_ROOT / "docs" / "kubernetes.md"


def code_lines(text: str) -> list[str]:
    """The indented (code block) lines of a Markdown text, unindented."""
    return [line.strip() for line in text.splitlines() if line.startswith("    ")]


def test_the_sentinel_settings_of_the_doc_are_accepted() -> None:
    """The ConfigMap lines it gives pass the settings check and name the Sentinels it says."""
    names = {"KILN_REDIS_SENTINELS", "KILN_REDIS_SENTINEL_MASTER"}
    lines = [line for line in code_lines(DOC.read_text()) if line.partition(":")[0] in names]
    config: dict[str, str] = yaml.safe_load("\n".join(lines))
    assert set(config) == names
    check_environment(config)  # an unknown KILN_* name: ValueError
    settings = StorageSettings(  # a malformed address: ValidationError
        redis_sentinels=config["KILN_REDIS_SENTINELS"],  # type: ignore[arg-type]
        redis_sentinel_master=config["KILN_REDIS_SENTINEL_MASTER"],
    )
    assert len(settings.sentinel_addresses) == 3
    assert {port for _, port in settings.sentinel_addresses} == {26379}


def test_the_port_forwards_of_the_doc_reach_services_of_the_cpu_demo() -> None:
    resources = render(OVERLAYS["cpu-demo"])
    services = by_kind(resources, "Service")
    namespace = yaml.safe_load((OVERLAYS["cpu-demo"] / "kustomization.yaml").read_text())[
        "namespace"
    ]
    forwards = re.findall(r"kubectl -n (\S+) port-forward svc/(\S+) (\d+):(\d+)", DOC.read_text())
    assert {name for _, name, _, _ in forwards} == {"kiln-api", "kiln-minio"}
    for ns, name, _, remote in forwards:
        assert ns == namespace
        assert int(remote) in {port["port"] for port in services[name]["spec"]["ports"]}
    # The presigned URLs the demo signs name the port the MinIO forward serves on this machine.
    public = by_kind(resources, "ConfigMap")["kiln-config"]["data"]["KILN_S3_PUBLIC_ENDPOINT_URL"]
    (local_minio,) = [local for _, name, local, _ in forwards if name == "kiln-minio"]
    assert public == f"http://localhost:{local_minio}"


def test_the_images_loaded_into_a_local_cluster_are_those_the_cpu_demo_runs() -> None:
    images = {
        container["image"]
        for container in iter_containers(render(OVERLAYS["cpu-demo"]))
        if container["image"].startswith("kiln:")
    }
    assert images == {"kiln:slim", "kiln:worker"}
    for command in ("kind load docker-image", "k3d image import"):
        (line,) = [line for line in code_lines(DOC.read_text()) if line.startswith(command)]
        assert images <= set(line.split())
    minikube = [line for line in code_lines(DOC.read_text()) if line.startswith("minikube image")]
    assert images <= set(" ".join(minikube).split())
