"""The OS side of a rank process.

It dies with its parent, names itself, takes its share of cores, tells its parent what it can
while the parent lives, and exits without blocking.

Two independent ways to notice the parent's death, because either alone has a gap:
PR_SET_PDEATHSIG fires when the *thread* that spawned us exits (Linux only), and the death pipe
only reaches EOF once every copy of its write end is closed (a stray fork keeps it open). The
watchdog also compares `getppid()` with the pid we were spawned by, once a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing.util as mp_util
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import torch

from kiln.common.tracing import flush_tracing
from kiln.gpu_worker.quiet import quiet_known_warnings

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_CHECK_S = 1.0


def set_parent_death_signal(sig: signal.Signals = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` when our parent dies; False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(death_pipe: Connection, parent_pid: int) -> threading.Thread:
    """Start a daemon thread that hard-exits this process once the parent is gone."""
    thread = threading.Thread(
        target=_watch_parent, args=(death_pipe, parent_pid), name="kiln-parent-watch", daemon=True
    )
    thread.start()
    return thread


def _watch_parent(death_pipe: Connection, parent_pid: int) -> None:
    while True:
        # The parent never writes: the pipe becomes readable only at EOF, when it died.
        if wait([death_pipe], timeout=PARENT_CHECK_S) or os.getppid() != parent_pid:
            break
    # No cleanup on purpose: the group is gone, and atexit handlers could block on collectives.
    os._exit(70)


def process_title(node_name: str, rank: int, world_size: int, device: str) -> str:
    """The title `ps` shows for a rank: node, rank, role and device."""
    role = "leader" if rank == 0 else "follower"
    return f"kiln-gpu-worker[{node_name}] rank {rank}/{world_size} {role} {device}"


def prepare_rank_process(
    *, title: str, parent_pid: int, death_pipe: Connection, threads: int
) -> None:
    """Everything a rank does first: signals, parent-death detection, title, CPU threads."""
    # Ctrl-C in a terminal reaches the whole process group; the parent decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So does a SIGTERM sent to the node's group (`kill -- -PGID`, a supervisor stopping the
    # group): in a group of its own, a rank is stopped by its owner's shutdown alone. A rank the
    # signal killed first looked like a rank death: the owner rebuilt the group while shutting
    # down (start-up lines printed again), then killed the new ranks mid-start, and the resource
    # tracker reported their semaphores (tqdm's lock, unlinked by `exit_rank`) as leaked.
    with contextlib.suppress(OSError):  # already a group leader: nothing to leave
        os.setpgid(0, 0)
    quiet_known_warnings()
    set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before PDEATHSIG was armed
        os._exit(70)
    watch_parent(death_pipe, parent_pid)
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # titles are a convenience; never a reason not to start
        logger.debug("setproctitle is not installed; keeping the default title")
    torch.set_num_threads(max(1, threads))


def send_quietly(conn: Connection, message: object) -> None:
    """Send to the parent if it is still there to read it."""
    with contextlib.suppress(OSError):  # the parent is gone; nobody is left to tell
        conn.send(message)


def exit_rank(code: int) -> NoReturn:
    """End the rank process now with `code`."""
    # os._exit: interpreter teardown could block in gloo's threads or collectives of dead peers.
    # multiprocessing's finalizers still run, so named semaphores that libraries create (tqdm's
    # lock) are unlinked here and not reported as leaked by the parent's resource tracker.
    with contextlib.suppress(Exception):
        mp_util._run_finalizers(0)  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        flush_tracing()  # the spans it holds: os._exit runs no atexit hook
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
