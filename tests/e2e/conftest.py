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

# One torch thread per rank for the clusters of `make test`'s tests, as the gpu_worker tests'
# groups run. The default (the cores shared out: 2 for a one-rank node on a 2-core machine) has
# each rank's intra-op threads spin against the other test processes': the tiny pipeline's 12
# steps at 320 pixels took 0.49 s of CPU at one thread, 5.3 s at two beside other work, and six
# tiny-node files under -n 3 went from 718 s (sum) to 280 s. The `slow` tests keep the default:
# they kill nodes at a step they wait for, at the pace they were written against.
ONE_THREAD_RANKS = {"KILN_CPU_THREADS_PER_RANK": "1"}


@contextlib.contextmanager
def clusters(
    redis_url: str, s3_server: str, tmp_path: Path, one_thread_ranks: bool = False
) -> Iterator[Callable[..., Cluster]]:
    """Makes clusters: each its own Redis namespace and bucket; workers stopped afterwards.

    `one_thread_ranks`: their nodes' ranks run ONE_THREAD_RANKS (else the default thread count).
    """
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
            **(ONE_THREAD_RANKS if one_thread_ranks else {}),
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
    redis_url: str, s3_server: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Cluster]]:
    """Clusters that live for one test."""
    slow = request.node.get_closest_marker("slow") is not None
    with clusters(redis_url, s3_server, tmp_path, one_thread_ranks=not slow) as make:
        yield make


@pytest.fixture(scope="module")
def module_cluster_factory(
    redis_url: str,
    s3_server: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Cluster]]:
    """Clusters shared by the tests of one module (as for `slow` ones if any test run of it is)."""
    slow = any(
        item.get_closest_marker("slow") is not None
        for item in request.session.items
        if item.path == request.path
    )
    folder = tmp_path_factory.mktemp("clusters")
    with clusters(redis_url, s3_server, folder, one_thread_ranks=not slow) as make:
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
