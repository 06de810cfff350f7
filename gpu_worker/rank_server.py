"""The rank server: rank processes forked from a server that has already imported torch and Kiln.

A spawned rank is a fresh interpreter that pays `import torch`, diffusers and Kiln's rank code
before it does anything (seconds on a small machine); a group start and every replacement of a
dead rank paid it. With `KILN_RANK_START=forkserver` (the default) the ranks come from
multiprocessing's forkserver instead: one server per node process, started on the first group
start, that imported `kiln.gpu_worker.rank_server_boot` (torch and the rank entry) and the code
that loads the node's pipelines (`pipeline_specs.loader_modules`: diffusers only for a node that
serves a diffusers pipeline), and forks one child per rank. A later group whose pipelines need
more replaces an idle server with one that imports both; beside live ranks, its ranks import
what is missing themselves. What holds under either start method:

- The server initialises neither CUDA nor torch's thread pools before it forks (importing torch
  does neither); each rank takes its device and sets its own thread count as a spawned one does.
- A served rank runs with what a spawned rank would have had at the moment it was started: the
  node's environment, cwd, sys.path (multiprocessing sends the last two with every child) and the
  node's current stdout/stderr (`NodeSide`). A server is tied to the environment it was started
  in, because libraries read some settings at import (huggingface_hub reads HF_HUB_OFFLINE): when
  the node's environment has changed, the next group start replaces an idle server, or spawns
  its ranks while the old server still has live ranks. A variable an import sets to its default
  in both processes (torch's inductor cache folder, `INDUCTOR_CACHE_ENV`) is no such change: a
  second server boot is seconds of CPU at every node start.
- Owner death: the node holds the only write end of each group's death pipe, so its EOF means
  "the node died" whatever the rank's OS parent is. A served rank's OS parent is the server, and
  the rank's parent checks (PR_SET_PDEATHSIG, `getppid`) watch the server: the server outlives
  its ranks (it exits when the node and every rank it forked are gone), so those fire only if
  the server itself is killed, and then the group dies and is rebuilt from a new server.
- The server leaves the node's process group (as ranks do), so a SIGTERM sent to the node's
  group does not kill it, and through it the ranks, while the node is shutting them down.

CPython's forkserver is one per process (`multiprocessing.forkserver`); the two private names
this module reads from it (its pid, `_stop`) are read here only, and a contract test
(tests/gpu_worker/test_rank_server.py) fails on the day they change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import multiprocessing as mp
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from kiln.gpu_worker.pipeline_specs import loader_modules

if TYPE_CHECKING:  # torch-free to import: a node may start the server before it imports torch
    from kiln.gpu_worker.ranks.args import RankArgs, RankPipes
    from kiln.gpu_worker.settings import RankStart

logger = logging.getLogger(__name__)

BOOT_MODULE = "kiln.gpu_worker.rank_server_boot"
# Set by pytest for each test phase: it changes all the time and no library reads it at import.
# The test pipelines' log files (kiln/settings_check.py lists them) are read as a pipeline loads,
# in the rank, never at import: a test process that names new ones keeps its warm server.
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST", "KILN_TEST_STEP_LOG", "KILN_TEST_COUNT_LOG"})


# Set by an import, not by the node: importing torch._dynamo (diffusers does) sets it to torch's
# default when it is unset, in the node as in the server, whose boot imports it from the same
# environment. A node that imports it after its server started must not replace that server.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def environment_key(environ: dict[str, str]) -> str:
    """A digest of the environment a server is tied to.

    All of it but `VOLATILE_ENV`, and but `INDUCTOR_CACHE_ENV` when it holds the default an
    import sets.
    """
    digest = hashlib.sha256()
    for name, value in sorted(environ.items()):
        if name in VOLATILE_ENV or (name == INDUCTOR_CACHE_ENV and _is_inductor_default(value)):
            continue
        digest.update(f"{name}\0{value}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def _is_inductor_default(value: str) -> bool:
    # Only once this process imported torch's cache folder rules: before, no import set it.
    rules = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    return rules is not None and value == os.path.abspath(rules.default_cache_dir())


class NodeSide:
    """What a served rank takes from the node as it is now: environment, stdout and stderr."""

    def __init__(
        self, environ: dict[str, str], out_fd: int | None = 1, err_fd: int | None = 2
    ) -> None:
        self.environ = environ
        self.out_fd = out_fd
        self.err_fd = err_fd

    @classmethod
    def now(cls) -> NodeSide:
        """The node's environment and its standard streams (those that are open)."""
        return cls(dict(os.environ), _open_fd(1), _open_fd(2))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled while multiprocessing starts the child: DupFd sends the descriptors along.
        out = None if self.out_fd is None else reduction.DupFd(self.out_fd)
        err = None if self.err_fd is None else reduction.DupFd(self.err_fd)
        return (_rebuild_node_side, (self.environ, out, err))

    def apply(self) -> None:
        """Make this process's environment and standard streams the node's."""
        os.environ.clear()
        os.environ.update(self.environ)
        for fd, target in ((self.out_fd, 1), (self.err_fd, 2)):
            if fd is not None and fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _open_fd(fd: int) -> int | None:
    try:
        os.fstat(fd)
    except OSError:  # a node started with a closed stdout: its ranks have none either
        return None
    return fd


def _rebuild_node_side(environ: dict[str, str], out: Any, err: Any) -> NodeSide:
    return NodeSide(
        environ, None if out is None else out.detach(), None if err is None else err.detach()
    )


def served_rank_main(node: NodeSide, args: RankArgs, pipes: RankPipes) -> None:
    """Entry point of a rank forked by the server: take the node's side, then run as a rank."""
    from kiln.gpu_worker.ranks.entry import rank_main  # imported already, by the server's boot

    _set_up_titles()
    node.apply()
    _reseed_numpy()
    # The OS parent is the server, which outlives the ranks; the node's death is the death pipe.
    rank_main(dataclasses.replace(args, parent_pid=os.getppid()), pipes)


def _set_up_titles() -> None:
    # setproctitle finds the argv area it rewrites (the title `ps` shows) through environ[0], on
    # its first use: that must come before the node's environment replaces the server's.
    try:
        import setproctitle
    except ImportError:  # titles are a convenience (gpu_worker/ranks/process.py)
        return
    setproctitle.getproctitle()


def _reseed_numpy() -> None:
    # Forked children share the server's global numpy generator; a spawned one seeds its own
    # (Python's `random` reseeds itself after a fork).
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


@dataclass
class _Server:
    """The one server of this node process: the environment it runs in, the ranks it forked."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    pid: int | None = None
    env_key: str | None = None
    preloaded: frozenset[str] = frozenset()  # the loader modules it imported before forking
    children: list[BaseProcess] = dataclasses.field(default_factory=list)


_server = _Server()


@dataclass(frozen=True)
class RankLaunch:
    """How one group's ranks start: from the rank server (`served`) or spawned."""

    context: ForkServerContext | SpawnContext
    served: bool

    def process(self, args: RankArgs, pipes: RankPipes, name: str) -> BaseProcess:
        """An unstarted rank process running `rank_main(args, pipes)`."""
        if self.served:
            return self.context.Process(
                target=served_rank_main, args=(NodeSide.now(), args, pipes), name=name
            )
        # Only a spawning node imports the rank entry (and with it every pipeline library): it
        # pickles `rank_main` by name. A served rank finds it imported by the server's boot.
        from kiln.gpu_worker.ranks.entry import rank_main

        return self.context.Process(target=rank_main, args=(args, pipes), name=name)

    def started(self, process: BaseProcess) -> None:
        """Note a started rank, so that its server is not replaced while it lives."""
        if self.served:
            with _server.lock:
                _server.children = [p for p in _server.children if p.is_alive()]
                _server.children.append(process)


def rank_launch(method: RankStart, specs: Iterable[str] = ()) -> RankLaunch:
    """The launch for a group of `specs` starting now; starts or replaces the server as needed."""
    if method == "spawn":
        return RankLaunch(mp.get_context("spawn"), served=False)
    context = mp.get_context("forkserver")
    env_key = environment_key(dict(os.environ))
    needed = loader_modules(specs)
    with _server.lock:
        _server.children = [p for p in _server.children if p.is_alive()]
        if _server.pid is not None and _server.env_key != env_key:
            if _server.children:
                logger.info("the environment changed under live ranks: spawning this group")
                return RankLaunch(mp.get_context("spawn"), served=False)
            _stop_server()
        preload = needed | _server.preloaded  # a server never drops what it has
        if _server.pid is not None and not needed <= _server.preloaded:
            if _server.children:
                preload = _server.preloaded  # beside live ranks: the new ones import the rest
            else:
                _stop_server()  # idle: replaced by one that has both
        context.set_forkserver_preload([BOOT_MODULE, *sorted(preload)])
        mp_forkserver.ensure_running()  # starts it, or a new one if the last one died
        pid = _forkserver_pid()
        if pid != _server.pid:
            _server.pid, _server.env_key, _server.preloaded = pid, env_key, preload
    return RankLaunch(context, served=True)


def warm_rank_server(method: RankStart, specs: Iterable[str] = ()) -> None:
    """Start the rank server for `specs` now, when ranks start from one.

    Its imports then overlap the caller's.
    """
    if method == "forkserver":
        rank_launch(method, specs)


def server_pid() -> int | None:
    """The pid of this node's rank server, None before it first started."""
    return _server.pid


def _forkserver_pid() -> int | None:
    pid: int | None = mp_forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    return pid


def _stop_server() -> None:
    # Only with no live rank of it left: a rank's parent checks watch the server.
    pid = _forkserver_pid()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # nothing to save; closing its pipe waits on strays
        with contextlib.suppress(ChildProcessError):
            mp_forkserver._forkserver._stop()  # type: ignore[attr-defined]
    _server.pid = _server.env_key = None
    _server.preloaded = frozenset()
