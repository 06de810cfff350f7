"""Shared helpers for gpu_worker tests: coordinators on CPU ranks, process checks via /proc.

Groups take seconds to start (each rank imports torch), so coordinators are module-scoped where
tests only read from them; tests that kill or rebuild groups use their own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.rank_server import NodeSide, rank_launch
from tests.gpu_worker.fixtures import spec
from tests.waiting import GENEROUS_S as GENEROUS_S

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

FIXTURE_PIPELINES = {
    "base": spec("base"),
    "raises": spec("raises"),
    "ooms": spec("ooms"),
    "exits": spec("exits"),
    "hangs": spec("hangs"),
    "noop": spec("noop"),
}


def request(
    request_id: str,
    pipeline: str = "base",
    prompt: str = "a red kiln",
    *,
    size: int = 64,
    steps: int = 3,
    seed: int = 1,
    guidance_scale: float = 5.0,
    **fields: object,
) -> GenerationRequest:
    """A small request; `size` sets width and height."""
    return GenerationRequest(
        request_id=request_id,
        pipeline=pipeline,
        prompt=prompt,
        width=size,
        height=size,
        steps=steps,
        seed=seed,
        guidance_scale=guidance_scale,
        **fields,  # type: ignore[arg-type]
    )


def cpu_ticks(pid: int) -> int:
    """`utime` + `stime` of a process, in clock ticks (from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def _served(node: NodeSide, target: Callable[..., None], rank: int, *args: object) -> None:
    node.apply()  # the test's environment and stderr, not the server's
    target(rank, *args)


def run_served_ranks(
    target: Callable[..., None], args: tuple[object, ...], world: int, timeout_s: float
) -> None:
    """Run `target(rank, *args)` in `world` processes forked by the rank server, to the end.

    As a node's ranks start (gpu_worker/rank_server.py): torch and the pipeline code are imported
    once per test process, not once per rank as spawned interpreters import them.
    """
    launch = rank_launch("forkserver")
    processes = [
        launch.context.Process(target=_served, args=(NodeSide.now(), target, rank, *args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
        launch.started(process)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    if any(process.is_alive() for process in processes):
        for process in processes:
            process.kill()
        pytest.fail(f"ranks did not finish within {timeout_s} s")
    exits = [process.exitcode for process in processes]
    if exits != [0] * world:
        pytest.fail(f"ranks exited with {exits} (their tracebacks are in the captured stderr)")


def start_coordinator(devices: str, pipelines: dict[str, str], **options: object) -> Coordinator:
    """A started coordinator on CPU ranks (no threads oversubscription: 1 per rank)."""
    options.setdefault("cpu_threads_per_rank", 1)
    config = GroupConfig(devices=[devices], pipelines=pipelines, **options)  # type: ignore[arg-type]
    coordinator = Coordinator(config)
    coordinator.start()
    return coordinator


@pytest.fixture
def coordinator_factory() -> Iterator[Callable[..., Coordinator]]:
    """Start coordinators inside a test; every one is shut down afterwards."""
    started: list[Coordinator] = []

    def factory(devices: str, pipelines: dict[str, str], **options: object) -> Coordinator:
        coordinator = start_coordinator(devices, pipelines, **options)
        started.append(coordinator)
        return coordinator

    yield factory
    for coordinator in started:
        coordinator.shutdown()
