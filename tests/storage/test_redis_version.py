"""The minimum Redis: every server here passes, an older one stops `kiln api` / `kiln worker`.

No Redis older than 6.2 is installed here, so an old one is a small RESP server that answers INFO
with an old `redis_version` and +OK to the rest of a connection's setup (AUTH, CLIENT SETINFO).
"""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator

import pytest

from kiln.storage.base import (
    MIN_REDIS_VERSION,
    UnsupportedRedis,
    redis_client,
    redis_version,
    require_supported_redis,
)
from kiln.storage.settings import StorageSettings
from kiln.tasks.cli.embedded import child_env, kiln_command

OLD_VERSION = "6.0.16"


def _commands(conn: socket.socket) -> Iterator[list[bytes]]:
    """The commands a client sends (RESP arrays of bulk strings) until it hangs up."""
    reader = conn.makefile("rb")
    while header := reader.readline():
        parts = []
        for _ in range(int(header[1:])):
            size = int(reader.readline()[1:])
            parts.append(reader.read(size + 2)[:-2])
        yield parts


def _serve(conn: socket.socket) -> None:
    with conn:
        for command in _commands(conn):
            if command[0].upper() == b"INFO":
                info = f"# Server\r\nredis_version:{OLD_VERSION}\r\n".encode()
                conn.sendall(b"$%d\r\n%s\r\n" % (len(info), info))
            else:
                conn.sendall(b"+OK\r\n")


@pytest.fixture
def old_redis_url() -> Iterator[str]:
    """The URL (with a password, which no message may show) of a Redis that says it is 6.0."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=_serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"redis://:hunter2@127.0.0.1:{port}/0"
    listener.close()


@pytest.mark.every_redis
def test_every_redis_here_is_supported(store_redis_url: str) -> None:
    settings = StorageSettings(redis_url=store_redis_url)
    require_supported_redis(settings)
    client = redis_client(settings)
    try:
        assert redis_version(client)[:2] >= MIN_REDIS_VERSION
    finally:
        client.close()


def test_an_older_redis_is_refused_in_one_line(old_redis_url: str) -> None:
    port = old_redis_url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(UnsupportedRedis) as caught:
        require_supported_redis(StorageSettings(redis_url=old_redis_url))
    assert str(caught.value) == (
        f"Redis {OLD_VERSION} at redis://:***@127.0.0.1:{port}/0 is older than the minimum 6.2 "
        "Kiln supports"
    )


def test_a_redis_that_does_not_answer_yet_is_not_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    require_supported_redis(StorageSettings(redis_url=f"redis://127.0.0.1:{port}/0"))


@pytest.mark.parametrize("command", [["api", "--port", "0"], ["worker"]])
def test_long_running_commands_stop_at_start_on_an_older_redis(
    old_redis_url: str, command: list[str]
) -> None:
    done = subprocess.run(
        kiln_command(*command),
        env=child_env(KILN_REDIS_URL=old_redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"kiln: Redis {OLD_VERSION} at redis://:***@")
    assert "hunter2" not in done.stderr + done.stdout
