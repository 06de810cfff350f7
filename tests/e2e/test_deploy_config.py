"""Deploy files agree with compose; presigned URLs name the public endpoint; node metrics' host."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from kiln.storage.s3_store import S3ObjectStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.embedded import free_port
from kiln.tasks.contract.settings import KilnSettings
from tests.e2e.cluster import REPO_ROOT, SLEEPY, Cluster
from tests.e2e.compose_stack import load_compose

DEPLOY = REPO_ROOT / "deploy"
PROVISIONING = DEPLOY / "grafana" / "provisioning"


def test_prometheus_and_grafana_point_at_the_compose_services() -> None:
    services = load_compose({})
    kiln_env = services["api"]["environment"]
    scraped = {
        target
        for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
        for config in job["static_configs"]
        for target in config["targets"]
    }
    nodes = {name for name, spec in services.items() if "--node-id" in spec.get("command", [])}
    api_port = services["api"]["ports"][0].rsplit(":", 1)[1]
    assert api_port == str(KilnSettings.model_fields["api_port"].default)  # what `kiln api` uses
    expected = {f"api:{api_port}"} | {f"{n}:{kiln_env['KILN_METRICS_PORT']}" for n in nodes}
    # Prometheus reaches a node from another container: not on the node's loopback default.
    assert kiln_env["KILN_METRICS_HOST"] == "0.0.0.0"
    assert expected <= scraped
    assert scraped - expected == {"127.0.0.1:9090"}  # Prometheus itself

    grafana = services["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    assert [s["url"] for s in sources["datasources"]] == ["http://prometheus:9090"]
    assert "9090:9090" in services["prometheus"]["ports"][0]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "kiln.yml").read_text())
    dashboard_in_container = Path(mounts["./deploy/grafana/kiln-dashboard.json"])
    assert providers["providers"][0]["options"]["path"] == str(dashboard_in_container.parent)
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_presigned_urls_use_the_published_minio_port() -> None:
    services = load_compose({})
    public = urlparse(services["api"]["environment"]["KILN_S3_PUBLIC_ENDPOINT_URL"])
    published = {port.split(":")[-2] for port in services["minio"]["ports"]}
    assert str(public.port) in published
    assert public.hostname != "minio"  # the name only compose's network resolves


def test_presigned_urls_name_the_public_endpoint(s3_settings: StorageSettings) -> None:
    inside = S3ObjectStore.from_settings(s3_settings)
    assert s3_settings.s3_endpoint_url is not None
    public = s3_settings.s3_endpoint_url.replace("127.0.0.1", "localhost")  # moto, another name
    outside = S3ObjectStore.from_settings(
        s3_settings.model_copy(update={"s3_public_endpoint_url": public})
    )
    key = f"{inside.prefix}/job-1/0.png"
    inside.put(key, b"png bytes", "image/png")
    assert inside.url(key).startswith(f"{s3_settings.s3_endpoint_url}/")
    assert outside.url(key).startswith(f"{public}/")
    assert httpx.get(outside.url(key), timeout=10).content == b"png bytes"


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is this machine only on Linux")
def test_a_node_serves_its_metrics_on_loopback_unless_told(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """As `kiln api`: by default only this machine reaches /metrics; KILN_METRICS_HOST opens it.

    127.0.0.2 is this machine by another address: refused by a socket bound to 127.0.0.1,
    answered by one bound to every interface.
    """
    cluster = cluster_factory()
    cluster.env.pop("KILN_METRICS_HOST", None)
    ports = {"default": free_port(), "0.0.0.0": free_port()}
    nodes = [
        cluster.start_worker(
            f"sleepy={SLEEPY}",
            extra_env={"KILN_METRICS_PORT": str(ports["default"])},
            wait=False,
        ),
        cluster.start_worker(
            f"sleepy={SLEEPY}",
            extra_env={"KILN_METRICS_PORT": str(ports["0.0.0.0"]), "KILN_METRICS_HOST": "0.0.0.0"},
            wait=False,
        ),
    ]
    for node in nodes:
        node.wait_ready()
    for port in ports.values():
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.2:{ports['default']}/metrics", timeout=10)
    opened = httpx.get(f"http://127.0.0.2:{ports['0.0.0.0']}/metrics", timeout=10)
    assert "kiln_node_jobs_running" in opened.text
