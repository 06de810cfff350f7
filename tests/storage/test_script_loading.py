"""Scripts load themselves: after Redis lost its script cache, direct calls and pipelines work.

Runs on a private redis-server: flushing the script cache of the shared test Redis would pull it
from under the other tests.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from tests.storage.helpers import job_in_state, new_job


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def private_store(tmp_path: Path) -> Iterator[JobStore]:
    """A JobStore on a redis-server of its own (skipped where redis-server is not installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = _free_port()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp_path]
    process = subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    store = JobStore.from_settings(
        StorageSettings(redis_url=url, storage_url=f"file://{tmp_path / 'outputs'}")
    )
    yield store
    store.redis.close()
    process.terminate()
    process.wait(timeout=30)


def test_scripts_reload_after_the_cache_is_flushed(private_store: JobStore) -> None:
    store = private_store
    job_id, token = job_in_state(store, JobState.RUNNING)
    store.redis.script_flush()
    store.set_progress(job_id, token, {"step": 1})  # NOSCRIPT: loaded and run again
    store.redis.script_flush()
    store.create_jobs([new_job() for _ in range(3)])  # the pipeline loads it before running
    assert store.queue_depth() == 3
    store.redis.script_flush()
    pipe = store.redis.pipeline(transaction=True)
    keys = [store.keys.job(job_id), store.keys.unpublished]
    store.scripts["mark_published"](keys, [job_id], client=pipe)
    assert pipe.execute() == [1]
