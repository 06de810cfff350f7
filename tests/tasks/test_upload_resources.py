"""The local upload PUT against a `kiln api` process: memory stays flat, descriptors run out softly.

A real `kiln api` subprocess (real Redis, a local store), so its memory and its file-descriptor
limit are its own: the body streams to disk (the process's peak RSS grows by far less than the
body), and a request that finds no descriptor left is a 503 with Retry-After, not a 500.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kiln.storage.apikeys import ApiKeyStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.auth import hash_api_key, new_api_key
from tests.tasks.raw_http import RawConnection

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
BODY_BYTES = 64 * MIB
NOFILE = 256  # the API's descriptor limit in the exhaustion test


@dataclass
class ApiProcess:
    """A `kiln api` process, its URL and an API key."""

    process: subprocess.Popen[bytes]
    port: int
    key: str

    @property
    def url(self) -> str:
        """Where it listens."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        """The key's Authorization header."""
        return {"Authorization": f"Bearer {self.key}"}

    def status(self, field: str) -> int:
        """A `/proc/<pid>/status` size in bytes (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def open_descriptors(self) -> int:
        """How many file descriptors the process holds."""
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(storage: StorageSettings, tmp: Path, nofile: int | None = None) -> ApiProcess:
    key = new_api_key()
    keys = ApiKeyStore.from_settings(storage)
    keys.create(hash_api_key(key), "alice")
    keys.redis.close()
    port = _free_port()
    env = {
        **os.environ,
        "KILN_REDIS_URL": storage.redis_url,
        "KILN_REDIS_NAMESPACE": storage.redis_namespace,
        "KILN_STORAGE_URL": storage.storage_url,
        "KILN_UPLOAD_MAX_BYTES": str(256 * MIB),
        "KILN_API_KEY_CACHE_S": "600",  # no Redis read for the key once known
        "KILN_HTTP_KEEPALIVE_TIMEOUT_S": "300",  # idle connections stay, holding descriptors
    }

    def limit_descriptors() -> None:
        if nofile is not None:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))

    with (tmp / f"api-{port}.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln.tasks.cli", "api", "--port", str(port)],
            env=env,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=limit_descriptors,
        )
    api = ApiProcess(process, port, key)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, (tmp / f"api-{port}.log").read_text()
        try:
            if httpx.get(f"{api.url}/healthz", timeout=2).status_code == 200:
                return api
        except httpx.HTTPError:
            time.sleep(0.1)
    raise TimeoutError("kiln api did not start")


def _stop(api: ApiProcess) -> None:
    api.process.terminate()
    try:
        api.process.wait(20)
    except subprocess.TimeoutExpired:
        api.process.kill()
        api.process.wait(10)


@pytest.fixture
def api_process(storage_settings: StorageSettings, tmp_path: Path) -> Iterator[ApiProcess]:
    """A `kiln api` process with no descriptor limit of its own."""
    api = _start(storage_settings, tmp_path)
    yield api
    _stop(api)


def _slot(api: ApiProcess, size: int) -> dict[str, str]:
    body = {"content_type": "application/jsonl", "bytes": size, "purpose": "batch"}
    answer = httpx.post(f"{api.url}/v1/uploads", json=body, headers=api.auth)
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def _pieces(total: int, piece: int = MIB) -> Iterator[bytes]:
    line = b'{"custom_id":"x","prompt":"a kiln"}\n'
    chunk = (line * (piece // len(line) + 1))[:piece]
    for start in range(0, total, piece):
        yield chunk[: min(piece, total - start)]


def test_a_large_upload_streams_to_disk(api_process: ApiProcess) -> None:
    slot = _slot(api_process, BODY_BYTES)
    before = api_process.status("VmRSS")
    Path(f"/proc/{api_process.process.pid}/clear_refs").write_text("5")  # peak := now
    headers = {**api_process.auth, "Content-Type": "application/jsonl"}
    put = httpx.put(slot["url"], content=_pieces(BODY_BYTES), headers=headers, timeout=120)
    assert put.status_code == 204, put.text
    grown = api_process.status("VmHWM") - before
    # a body held whole would grow the peak by at least its size; streamed, by a few pieces
    assert grown < BODY_BYTES // 2, f"peak RSS grew {grown / MIB:.1f} MiB"


def test_out_of_descriptors_is_a_503_with_retry_after(
    storage_settings: StorageSettings, tmp_path: Path
) -> None:
    api = _start(storage_settings, tmp_path, nofile=NOFILE)
    held: list[socket.socket] = []
    try:
        slot = _slot(api, 100)
        auth = (b"Authorization", f"Bearer {api.key}".encode())
        put_head = [auth, (b"Content-Type", b"application/jsonl")]
        path = ("/v1/uploads/local?upload_id=" + slot["upload_id"]).encode()
        with RawConnection(api.port) as probe:
            assert probe.request("GET", b"/healthz").status == 200  # accepted before the rest
            # every descriptor taken by idle keep-alive connections (one each)
            while api.open_descriptors() < NOFILE:
                conn = socket.create_connection(("127.0.0.1", api.port), timeout=30)
                held.append(conn)
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                assert conn.recv(4096).startswith(b"HTTP/1.1 200")
            refused = probe.request("PUT", path, put_head, b"x" * 100)
            assert refused.status == 503, refused.body
            assert refused.headers.get("retry-after") == "1"
            assert b"out of file descriptors" in refused.body
            for conn in held:  # descriptors come back: the same request then succeeds
                conn.close()
            held.clear()
            assert probe.request("PUT", path, put_head, b"x" * 100).status == 204
    finally:
        for conn in held:
            conn.close()
        _stop(api)
