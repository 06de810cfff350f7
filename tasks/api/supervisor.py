"""`kiln api --workers N` (N > 1): one port, N API processes, and this small supervisor over them.

The supervisor binds one listening socket per child, all on the same port with SO_REUSEPORT, and
starts N children (`python -m kiln.tasks.cli api --fd FD`) that each inherit theirs; the kernel
spreads new connections over the sockets by their addresses. (One socket shared by all children
spread badly: a child woken by a burst of connections accepts the whole burst, so 8 keep-alive
clients landed 8-0 or 7-1 as often as 4-4.) Each child is a full `kiln api` (`api.app.serve_api`:
start-up checks, deadlines, keep-alive, body limits, logs); the supervisor never loads the app. It

- gives the children one fresh `PROMETHEUS_MULTIPROC_DIR`, so that any child's `/metrics` counts
  every child's requests (`api.metrics`), and removes it at exit;
- forwards SIGTERM/SIGINT as SIGTERM (a graceful stop), a second one as SIGINT (uvicorn's forced
  stop), waits for every child and exits 0 when they all stopped cleanly;
- restarts a child that dies unexpectedly after a backoff doubling from 0.5 s to 30 s, reset once a
  child has lived `STEADY_S`; a slot whose child fails that fast `MAX_FAST_FAILURES` times in a row
  (a broken configuration, say) stops everything with status 1. A dead child's socket stays open
  in the supervisor: connections the kernel gives it meanwhile wait for the replacement (seconds)
  instead of being reset;
- has the kernel send each child SIGTERM should the supervisor die, even by SIGKILL.

Its own uvicorn `workers=` would need an import string and a picklable configuration, and the
deadline protocol class (`api.http_guard`) is built at run time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import FrameType

log = logging.getLogger(__name__)

TICK_S = 0.2  # how often dead children are looked for
STEADY_S = 10.0  # a child that lived this long resets its slot's backoff
MAX_FAST_FAILURES = 5
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
LISTEN_BACKLOG = 2048  # uvicorn's default
CLEAN_EXITS = {0, -signal.SIGTERM, -signal.SIGINT}  # uvicorn re-raises the signal it stopped on
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def listen_socket(host: str, port: int) -> socket.socket:
    """One child's listening socket on host:port, shared with the others' (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server(
        (host, port), family=family, backlog=LISTEN_BACKLOG, reuse_port=True
    )
    sock.set_inheritable(True)
    return sock


def stop_with_parent(supervisor_pid: int) -> None:
    """In a child before exec: SIGTERM once the supervisor is gone, even killed with SIGKILL.

    The kernel only signals a parent's death that happens after the request: a supervisor killed
    between the fork and this call would leave the child serving on, so the child looks once more
    at its parent after asking, and leaves at once if it has already been handed to another.
    """
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor_pid:
        os._exit(0)


@dataclass
class Slot:
    """One of the N places a child runs in: its socket and process, its start and failures."""

    index: int
    sock: socket.socket
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    fast_failures: int = 0
    restart_at: float = 0.0


class Supervisor:
    """Binds, starts, watches, restarts and stops the children serving host:port."""

    def __init__(self, host: str, port: int, workers: int, env: dict[str, str]) -> None:
        first = listen_socket(host, port)
        self.address = (host, int(first.getsockname()[1]))  # port 0: the one the first got
        self.slots = [
            Slot(i, first if i == 0 else listen_socket(*self.address)) for i in range(workers)
        ]
        self.env = env
        self.stopping = threading.Event()
        self.signals = 0
        self.failed = False

    def run(self) -> int:
        """Serve until a signal (status 0 when every child stops cleanly) or a failing slot (1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            for slot in self.slots:
                self._start(slot)
            while not self.stopping.wait(TICK_S):
                for slot in self.slots:
                    self._watch(slot)
            return self._stop_all()
        finally:
            for slot in self.slots:
                slot.sock.close()

    def _on_signal(self, _sig: int, _frame: FrameType | None) -> None:
        # Only flags here (the main loop acts): a handler that logged could meet logging's lock.
        self.signals += 1
        self.stopping.set()

    def _send_all(self, sig: int) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(sig)

    def _start(self, slot: Slot) -> None:
        fd = slot.sock.fileno()
        command = [sys.executable, "-m", "kiln.tasks.cli", "api", "--fd", str(fd)]
        # preexec_fn is safe here: the supervisor runs no threads
        supervisor_pid = os.getpid()
        slot.process = subprocess.Popen(
            command,
            env=self.env,
            pass_fds=(fd,),
            preexec_fn=lambda: stop_with_parent(supervisor_pid),
        )
        slot.started = time.monotonic()
        log.info("api supervisor: child %d started (pid %d)", slot.index, slot.process.pid)

    def _watch(self, slot: Slot) -> None:
        """Restart `slot`'s child once it died and its backoff ran out."""
        now = time.monotonic()
        if slot.process is None:
            if now >= slot.restart_at:
                self._start(slot)
            return
        status = slot.process.poll()
        if status is not None and not self.stopping.is_set():
            slot.process = None
            self._failed(slot, now, status)

    def _failed(self, slot: Slot, now: float, status: int) -> None:
        """Schedule `slot`'s restart, or stop everything once it failed too often."""
        lived = now - slot.started
        slot.fast_failures = slot.fast_failures + 1 if lived < STEADY_S else 0
        if slot.fast_failures >= MAX_FAST_FAILURES:
            log.error(
                "api supervisor: child %d failed %d times in a row", slot.index, MAX_FAST_FAILURES
            )
            self.failed = True
            self.stopping.set()
            return
        delay = min(BACKOFF_FIRST_S * 2 ** max(slot.fast_failures - 1, 0), BACKOFF_MAX_S)
        slot.restart_at = now + delay
        log.warning(
            "api supervisor: child %d exited with status %s after %.1f s; restarting in %.1f s",
            slot.index,
            status,
            lived,
            delay,
        )

    def _stop_all(self) -> int:
        """Stop every child (a second signal forces them), wait for them; the exit status."""
        log.info("api supervisor: stopping %d processes", len(self.slots))
        self._send_all(signal.SIGTERM)
        forced = False
        while any(s.process is not None and s.process.poll() is None for s in self.slots):
            if self.signals > 1 and not forced:
                log.warning("api supervisor: second signal, forcing the children to stop")
                self._send_all(signal.SIGINT)  # uvicorn's forced exit: SIGINT after a stop began
                forced = True
            time.sleep(TICK_S)
        clean = not self.failed
        for slot in self.slots:
            status = None if slot.process is None else slot.process.returncode
            if status is not None and status not in CLEAN_EXITS:
                log.warning("api supervisor: child %d stopped with status %s", slot.index, status)
                clean = False
        return 0 if clean else 1


def serve_workers(host: str, port: int, workers: int) -> int:
    """Run `workers` API processes on host:port until stopped; the exit status for `kiln api`."""
    metrics_dir = tempfile.mkdtemp(prefix="kiln-api-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    try:
        supervisor = Supervisor(host, port, workers, env)
        log.info("api supervisor: %d processes on %s:%d", workers, *supervisor.address)
        return supervisor.run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
