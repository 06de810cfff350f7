"""A KILN_REDIS_URL that redis-py cannot use stops every command in one line, exit 2.

`kiln config` included: what it accepts is what every other command uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.storage.settings import StorageSettings

KILN = Path(sys.executable).with_name("kiln")  # the console script installed next to python
TIMEOUT_S = 60.0


def run_kiln(*args: str, redis_url: str) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS...` to completion with KILN_REDIS_URL set to `redis_url`."""
    return subprocess.run(
        [str(KILN), *args],
        env={**os.environ, "KILN_REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("config",),
        ("submit", "a fox"),
        ("status", "0123456789ab"),
        ("batch", "list"),
        ("api", "--port", "0"),
        ("worker", "--concurrency", "1"),
    ],
)
def test_a_bare_host_and_port_is_one_line_with_the_url_to_write(args: tuple[str, ...]) -> None:
    done = run_kiln(*args, redis_url="127.0.0.1:6420")
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "kiln: invalid setting KILN_REDIS_URL: redis_url has no scheme: write "
        "'redis://127.0.0.1:6420/0' (rediss:// for TLS, unix:///path/to/redis.sock for a socket)\n"
    )
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("redis_url", "shown"),
    [
        ("http://127.0.0.1:6420/0", "must start with redis://, rediss:// or unix://"),
        ("redis://127.0.0.1:99999/0", "Port out of range"),
    ],
)
def test_another_unusable_url_is_one_line(redis_url: str, shown: str) -> None:
    done = run_kiln("submit", "a fox", redis_url=redis_url)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("kiln: invalid setting KILN_REDIS_URL: ")
    assert shown in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_the_password_of_a_refused_url_is_masked() -> None:
    with pytest.raises(ValidationError) as refused:
        StorageSettings(redis_url="kiln:hunter2@redis.internal:6379/1")
    errors = refused.value.errors()
    (message,) = [error["msg"] for error in errors if error["type"] == "value_error"]
    assert "hunter2" not in message  # the message is what the CLI prints
    assert "'redis://kiln:***@redis.internal:6379/1'" in message


@pytest.mark.parametrize(
    "redis_url",
    ["redis://127.0.0.1:6379/0", "rediss://user:pw@h:6380/2", "unix:///run/redis.sock?db=1"],
)
def test_the_urls_redis_py_takes_are_kept_as_written(redis_url: str) -> None:
    assert StorageSettings(redis_url=redis_url).redis_url == redis_url
