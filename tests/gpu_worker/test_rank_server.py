"""The rank server (gpu_worker/rank_server.py): ranks forked from it start as spawned ones would.

Each test reads what the ranks report about themselves (fixtures/probe.py) and the process table:
the rank's OS parent, its environment, threads and stderr, and which processes are left.
"""

from __future__ import annotations

import json
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.gpu_worker import rank_server
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.group import WorkerGroup
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.conftest import process_gone
from tests.gpu_worker.fixtures import spec
from tests.gpu_worker.fixtures.probe import PROBE_DIR_ENV, PROBE_VALUE_ENV
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def probe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the probe ranks of this test write their reports to."""
    monkeypatch.setenv(PROBE_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def groups() -> Iterator[list[WorkerGroup]]:
    """Groups a test starts; every one is shut down afterwards."""
    started: list[WorkerGroup] = []
    yield started
    for group in started:
        group.shutdown()


def start_probe_group(
    groups: list[WorkerGroup], ranks: int = 1, threads: int = 1, **options: object
) -> WorkerGroup:
    """A started CPU group of probe ranks (tracked by `groups`)."""
    config = GroupConfig(
        devices=[f"cpu:{ranks}"],
        pipelines={"probe": spec("probe")},
        cpu_threads_per_rank=threads,
        **options,  # type: ignore[arg-type]
    )
    group = WorkerGroup(config)
    groups.append(group)
    group.start()
    return group


def probes(folder: Path, group: WorkerGroup) -> list[dict[str, object]]:
    """What each rank of `group` reported at load, in rank order."""
    return [json.loads((folder / f"{pid}.json").read_text()) for pid in group.pids]


def kill_server() -> None:
    """SIGKILL this node's rank server, if one runs (the next group start makes a new one)."""
    pid = rank_server.server_pid()
    if pid is not None and not process_gone(pid):
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: process_gone(pid), what=f"server {pid} gone")


def test_the_forkserver_internals_the_module_reads_are_there() -> None:
    # gpu_worker/rank_server.py reads the server's pid and stops it through these private names.
    server = mp_forkserver._forkserver
    assert hasattr(server, "_forkserver_pid")
    assert callable(getattr(server, "_stop", None))


def test_served_ranks_get_the_nodes_environment_threads_and_stderr(
    probe_dir: Path, groups: list[WorkerGroup], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROBE_VALUE_ENV, "first")
    kill_server()  # the server below starts while stderr goes to `started_with`
    started_with, later = tmp_path / "server-stderr.txt", tmp_path / "node-stderr.txt"
    saved_stderr = os.dup(2)
    try:
        with started_with.open("w") as first:
            os.dup2(first.fileno(), 2)
            one = start_probe_group(groups, threads=1)
        with later.open("w") as second:
            os.dup2(second.fileno(), 2)
            two = start_probe_group(groups, ranks=1, threads=2)
    finally:
        os.dup2(saved_stderr, 2)
        os.close(saved_stderr)
    server = rank_server.server_pid()
    (first_rank,), (second_rank,) = probes(probe_dir, one), probes(probe_dir, two)
    # Both forked by the same server, not by this process.
    assert server is not None
    assert server != os.getpid()
    assert first_rank["ppid"] == second_rank["ppid"] == server
    assert first_rank["value"] == second_rank["value"] == "first"
    assert first_rank["cwd"] == second_rank["cwd"] == os.getcwd()
    assert (first_rank["threads"], second_rank["threads"]) == (1, 2)
    assert first_rank["cuda_initialized"] is second_rank["cuda_initialized"] is False
    # Each rank writes to the stderr the node had when the rank started, not the server's.
    assert f'"pid": {one.pids[0]}' in started_with.read_text()
    assert f'"pid": {two.pids[0]}' in later.read_text()
    assert f'"pid": {two.pids[0]}' not in started_with.read_text()
    # The server holds neither stream of the node it started under (a node capturing its
    # streams waits at exit for their end of file).
    server_streams = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in (1, 2)}
    assert str(started_with) not in server_streams


def test_a_changed_environment_never_reaches_ranks_through_a_stale_server(
    probe_dir: Path, groups: list[WorkerGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROBE_VALUE_ENV, "before")
    before = start_probe_group(groups)
    old_server = rank_server.server_pid()
    monkeypatch.setenv(PROBE_VALUE_ENV, "after")
    # The old server still has a live rank: this group is spawned, with the new environment.
    during = start_probe_group(groups)
    (before_rank,), (during_rank,) = probes(probe_dir, before), probes(probe_dir, during)
    assert before_rank["ppid"] == old_server
    assert before_rank["value"] == "before"
    assert during_rank["ppid"] == os.getpid()
    assert during_rank["value"] == "after"
    assert rank_server.server_pid() == old_server
    before.shutdown()
    during.shutdown()
    # No live rank of it left: the old server is replaced by one started in the new environment.
    after = start_probe_group(groups)
    (after_rank,) = probes(probe_dir, after)
    assert rank_server.server_pid() not in (None, old_server)
    assert after_rank["ppid"] == rank_server.server_pid()
    assert after_rank["value"] == "after"
    assert old_server is not None
    assert process_gone(old_server)


def test_the_inductor_folder_an_import_sets_keeps_the_server_a_folder_of_the_nodes_does_not(
    probe_dir: Path, groups: list[WorkerGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch._dynamo  # noqa: F401  (what a node importing diffusers imports)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv(rank_server.INDUCTOR_CACHE_ENV, raising=False)
    start_probe_group(groups).shutdown()  # a server started before the node's import set it
    server = rank_server.server_pid()
    monkeypatch.setenv(rank_server.INDUCTOR_CACHE_ENV, default_cache_dir())  # as the import does
    kept = start_probe_group(groups)
    (kept_rank,) = probes(probe_dir, kept)
    assert rank_server.server_pid() == server
    assert kept_rank["ppid"] == server
    kept.shutdown()
    # A folder the node chose is its environment: the idle server is replaced.
    monkeypatch.setenv(rank_server.INDUCTOR_CACHE_ENV, str(probe_dir / "inductor"))
    replaced = start_probe_group(groups)
    (replaced_rank,) = probes(probe_dir, replaced)
    assert rank_server.server_pid() not in (None, server)
    assert replaced_rank["ppid"] == rank_server.server_pid()


def test_a_server_imports_diffusers_only_for_a_node_whose_pipelines_load_it(
    probe_dir: Path, groups: list[WorkerGroup]
) -> None:
    kill_server()
    plain = start_probe_group(groups)  # a python: pipeline: torch and the rank entry only
    (plain_rank,) = probes(probe_dir, plain)
    first = rank_server.server_pid()
    assert plain_rank["ppid"] == first
    assert plain_rank["diffusers_imported"] is False
    # Beside live ranks the server stays: ranks that need more import it themselves.
    rank_server.rank_launch("forkserver", ["tiny"])
    assert rank_server.server_pid() == first
    plain.shutdown()
    # Idle, it is replaced by one that imports the diffusers loader before it forks.
    rank_server.rank_launch("forkserver", ["tiny"])
    grown = rank_server.server_pid()
    assert grown not in (None, first)
    # A server that has more serves a node that needs less.
    again = start_probe_group(groups)
    (again_rank,) = probes(probe_dir, again)
    assert again_rank["ppid"] == grown
    assert again_rank["diffusers_imported"] is True


def test_spawn_starts_each_rank_as_a_fresh_interpreter(
    probe_dir: Path, groups: list[WorkerGroup]
) -> None:
    group = start_probe_group(groups, settings=GpuWorkerSettings(rank_start="spawn"))
    (rank,) = probes(probe_dir, group)
    assert rank["ppid"] == os.getpid()


def test_a_killed_server_takes_its_group_down_and_the_next_start_makes_a_new_one(
    probe_dir: Path, groups: list[WorkerGroup]
) -> None:
    deaths: list[str] = []
    died = threading.Event()
    config = GroupConfig(
        devices=["cpu:2"], pipelines={"probe": spec("probe")}, cpu_threads_per_rank=1
    )

    def on_death(reason: str) -> None:
        deaths.append(reason)
        died.set()

    group = WorkerGroup(config, on_death=on_death)
    groups.append(group)
    group.start()
    server = rank_server.server_pid()
    assert server is not None
    os.kill(server, signal.SIGKILL)
    # The ranks' parent checks watch the server: they end, and the owner hears of it once.
    assert died.wait(60)
    assert len(deaths) == 1
    assert "rank" in deaths[0]
    wait_until(lambda: [pid for pid in group.pids if not process_gone(pid)], lambda left: not left)
    again = start_probe_group(groups, ranks=2)
    assert rank_server.server_pid() not in (None, server)
    assert {p["ppid"] for p in probes(probe_dir, again)} == {rank_server.server_pid()}


@pytest.mark.slow
def test_a_sigkilled_node_leaves_no_rank_and_no_server() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", "tests.gpu_worker.fixtures.orphan_parent", "2"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as node:  # closes the pipe and reaps the node on the way out
        try:
            assert node.stdout is not None
            started = json.loads(node.stdout.readline())
            pids, server = started["pids"], started["server"]
            assert len(pids) == 2
            assert server is not None
            assert server not in pids
            assert not any(process_gone(pid) for pid in [*pids, server])
            node.send_signal(signal.SIGKILL)
            node.wait(30)
            wait_until(
                lambda: [pid for pid in [*pids, server] if not process_gone(pid)],
                lambda left: not left,
            )
        finally:
            node.kill()


BOOT_WATCH = """
import json, os, sys, threading
import torch
calls = []
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device"):
    def watch(*args, _name=name, _original=getattr(torch.cuda, name), **kwargs):
        calls.append(_name)
        return _original(*args, **kwargs)
    setattr(torch.cuda, name, watch)
import kiln.gpu_worker.rank_server_boot  # what the server imports (it sends stdout to /dev/null)
from kiln.gpu_worker.pipeline_specs import LOADER_MODULES
for module in sorted(set().union(*LOADER_MODULES.values())):  # and then the pipelines' loaders
    __import__(module)
report = {"cuda_calls": calls, "cuda_initialized": torch.cuda.is_initialized(),
          "python_threads": threading.active_count(), "pgid_is_own": os.getpgid(0) == os.getpid()}
with open(sys.argv[1], "w") as out:
    json.dump(report, out)
"""


def test_the_server_boot_touches_no_cuda_and_starts_no_python_thread(tmp_path: Path) -> None:
    # A CUDA device count asked before the fork would poison every forked rank's CUDA; the
    # imports run in a process of their own here, as in the server.
    out = tmp_path / "boot.json"
    subprocess.run([sys.executable, "-c", BOOT_WATCH, str(out)], cwd=ROOT, check=True, timeout=300)
    report = json.loads(out.read_text())
    assert report == {
        "cuda_calls": [],
        "cuda_initialized": False,
        "python_threads": 1,
        "pgid_is_own": True,
    }
