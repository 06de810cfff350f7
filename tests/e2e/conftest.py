"""Fixtures for end-to-end tests: a cluster namespace on real Redis + moto S3, fault injectors."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest

from kiln.tasks.api.app import create_app
from kiln.tasks.client.client import KilnClient
from tests.conftest import delete_namespace
from tests.e2e.cluster import Cluster
from tests.e2e.services import FlakyProxy, PrivateRedis
from tests.tasks.helpers import ThreadServer, api_settings

S3_REGION = "us-east-1"
S3_KEY = "testing"  # moto accepts any credentials

# Short timings so recovery is observable in seconds rather than minutes.
FAST_RECOVERY_ENV = {
    "KILN_LEASE_TTL_S": "3",
    "KILN_HEARTBEAT_INTERVAL_S": "0.5",
    "KILN_REAPER_INTERVAL_S": "0.5",
    "KILN_RETRY_BACKOFF_S": "0.2",
    "KILN_RETRY_BACKOFF_MAX_S": "1",
    "KILN_LEASE_BUSY_DELAY_S": "1",
    "KILN_DRAIN_GRACE_S": "5",
    "KILN_UPLOAD_RETRY_S": "120",
    "KILN_PROGRESS_INTERVAL_S": "0.05",
    "KILN_PIPELINES": '["default", "tiny", "tiny-video", "sleepy"]',
    "KILN_METRICS_PORT": "0",  # several nodes per test: none serves metrics unless asked
}


@contextlib.contextmanager
def clusters(redis_url: str, s3_server: str, tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """Makes clusters: each its own Redis namespace and bucket; workers stopped afterwards."""
    made: list[tuple[Cluster, str, str]] = []

    def make(**overrides: str) -> Cluster:
        namespace = f"kiln-e2e-{secrets.token_hex(5)}"
        bucket = f"kiln-e2e-{secrets.token_hex(5)}"
        boto3.client(
            "s3",
            endpoint_url=s3_server,
            region_name=S3_REGION,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_KEY,
        ).create_bucket(Bucket=bucket)
        folder = tmp_path / namespace
        folder.mkdir()
        env = {
            **os.environ,
            **FAST_RECOVERY_ENV,
            "KILN_REDIS_URL": redis_url,
            "KILN_REDIS_NAMESPACE": namespace,
            "KILN_STORAGE_URL": f"s3://{bucket}/outputs",
            "KILN_S3_ENDPOINT_URL": s3_server,
            "KILN_S3_REGION": S3_REGION,
            "KILN_S3_ADDRESSING_STYLE": "path",
            "KILN_S3_ACCESS_KEY_ID": S3_KEY,
            "KILN_S3_SECRET_ACCESS_KEY": S3_KEY,
            "KILN_TEST_COMPLETIONS": str(folder / "completions.log"),
            "PYTHONUNBUFFERED": "1",
            **overrides,
        }
        cluster = Cluster(env=env, tmp=folder)
        made.append((cluster, env["KILN_REDIS_URL"], namespace))
        return cluster

    try:
        yield make
    finally:
        for cluster, url, namespace in made:
            cluster.stop_all()
            with contextlib.suppress(Exception):  # a private Redis may be gone already
                delete_namespace(url, namespace)


@pytest.fixture
def cluster_factory(
    redis_url: str, s3_server: str, tmp_path: Path
) -> Iterator[Callable[..., Cluster]]:
    """Clusters that live for one test."""
    with clusters(redis_url, s3_server, tmp_path) as make:
        yield make


@pytest.fixture(scope="module")
def module_cluster_factory(
    redis_url: str, s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Cluster]]:
    """Clusters shared by the tests of one module."""
    with clusters(redis_url, s3_server, tmp_path_factory.mktemp("clusters")) as make:
        yield make


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[KilnClient]:
    """A client of an in-process API (auth off) in front of the module's own `cluster` fixture."""
    with (
        ThreadServer(create_app(api_settings(auth_enabled=False), cluster.storage_settings)) as api,
        KilnClient(api.url) as made,
    ):
        yield made


@pytest.fixture
def s3_proxy(s3_server: str) -> Iterator[FlakyProxy]:
    """A proxy in front of the moto server that the test can take down and bring back."""
    target = urlparse(s3_server)
    proxy = FlakyProxy(target.hostname or "127.0.0.1", target.port or 80)
    yield proxy
    proxy.close()


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A redis-server of this test's own (AOF on), never the machine's shared one."""
    folder = tmp_path / "private-redis"
    folder.mkdir()
    server = PrivateRedis(folder)
    yield server
    server.stop()
