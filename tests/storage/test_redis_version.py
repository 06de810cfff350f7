"""The minimum Redis: every server here passes, an older one stops `kiln api` / `kiln worker`.

No Redis older than 6.2 is installed here, so an old one is a small RESP server that answers INFO
with an old `redis_version`, the connection's opening `HELLO 3 AUTH ...` as that version does, and
+OK to the rest of a connection's setup (AUTH, CLIENT SETINFO, SELECT). redis-py opens every
connection with HELLO 3 and, since 8.2, checks its reply: 6.0 answers with a RESP3 map, 5.x with
an unknown-command error, on which redis-py falls back to RESP2's AUTH. (An earlier stand-in
answered +OK to HELLO, which no Redis does; redis-py 8.1 let that pass, 8.2 does not.)
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
# The last version without HELLO: redis-py must fall back to RESP2 with it.
PRE_HELLO_VERSION = "5.0.14"


def _commands(conn: socket.socket) -> Iterator[list[bytes]]:
    """The commands a client sends (RESP arrays of bulk strings) until it hangs up."""
    reader = conn.makefile("rb")
    while header := reader.readline():
        parts = []
        for _ in range(int(header[1:])):
            size = int(reader.readline()[1:])
            parts.append(reader.read(size + 2)[:-2])
        yield parts


def _hello_reply(version: str) -> bytes:
    """What a Redis of `version` answers to `HELLO 3 ...`: its RESP3 map, or no such command."""
    if int(version.split(".")[0]) < 6:
        return b"-ERR unknown command `HELLO`, with args beginning with: `3`, \r\n"
    fields = [
        ("server", b"+redis"),
        ("version", b"+" + version.encode()),
        ("proto", b":3"),
        ("id", b":7"),
        ("mode", b"+standalone"),
        ("role", b"+master"),
        ("modules", b"*0"),
    ]
    return b"%%%d\r\n" % len(fields) + b"".join(
        b"+%s\r\n%s\r\n" % (key.encode(), value) for key, value in fields
    )


def _serve(conn: socket.socket, version: str) -> None:
    with conn:
        for command in _commands(conn):
            name = command[0].upper()
            if name == b"INFO":
                info = f"# Server\r\nredis_version:{version}\r\n".encode()
                conn.sendall(b"$%d\r\n%s\r\n" % (len(info), info))
            elif name == b"HELLO":
                conn.sendall(_hello_reply(version))
            else:
                conn.sendall(b"+OK\r\n")


@pytest.fixture(params=[OLD_VERSION, PRE_HELLO_VERSION])
def old_redis(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """(URL, version) of a Redis older than 6.2; the URL has a password no message may show."""
    version: str = request.param
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=_serve, args=(conn, version), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"redis://:hunter2@127.0.0.1:{port}/0", version
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


def test_an_older_redis_is_refused_in_one_line(old_redis: tuple[str, str]) -> None:
    url, version = old_redis
    port = url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(UnsupportedRedis) as caught:
        require_supported_redis(StorageSettings(redis_url=url))
    assert str(caught.value) == (
        f"Redis {version} at redis://:***@127.0.0.1:{port}/0 is older than the minimum 6.2 "
        "Kiln supports"
    )


def test_a_redis_that_does_not_answer_yet_is_not_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    require_supported_redis(StorageSettings(redis_url=f"redis://127.0.0.1:{port}/0"))


@pytest.mark.parametrize("command", [["api", "--port", "0"], ["worker"]])
def test_long_running_commands_stop_at_start_on_an_older_redis(
    old_redis: tuple[str, str], command: list[str]
) -> None:
    url, version = old_redis
    done = subprocess.run(
        kiln_command(*command),
        env=child_env(KILN_REDIS_URL=url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"kiln: Redis {version} at redis://:***@")
    assert "hunter2" not in done.stderr + done.stdout
