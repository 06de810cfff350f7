"""Replica groups: a node's devices split into several independent worker groups.

`kiln worker --group-size K` splits the node's ranks into groups of K, each its own rank-0 led
group with its own coordinator (its own batching, deadlines and rebuilds). `Replicas` fronts them
with the coordinator's own interface: `submit` hands each request to the least busy group (fewest
requests submitted and not yet finished; among equals the first), where it waits and batches with
that group's other requests. A choice is final: a request never moves to another group.

Small models gain from several groups (each device runs its own batch, with no collective per
step); a model that needs several devices for memory or speed wants one group over all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from kiln.common.limits import DeclaredLimits
from kiln.common.request import InputSchema
from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.counters import GroupCounters
from kiln.gpu_worker.pipelines import prepare_pipeline
from kiln.gpu_worker.protocol import (
    GenerationRequest,
    GenerationResult,
    StepCheckpoint,
    StepProgress,
)
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.gpu_worker.tickets import BatchStart, ShouldStop


def split_group(config: GroupConfig, group_size: int) -> list[GroupConfig]:
    """One config per replica group of `group_size` ranks, in device order.

    Each group gets `config`'s options, its own node name (`<node>.g<index>`, in its ranks'
    process titles) and the CPU threads the whole node's ranks would get, so several groups do
    not oversubscribe the cores.
    """
    world = config.world()
    if group_size < 1 or len(world) % group_size:
        raise ValueError(
            f"{len(world)} device(s) ({', '.join(world)}) do not split into groups of {group_size}"
        )
    if group_size == len(world):
        return [config]
    threads = config.threads_per_rank()
    return [
        replace(
            config,
            devices=world[start : start + group_size],
            node_name=f"{config.node_name}.g{start // group_size}",
            cpu_threads_per_rank=threads,
        )
        for start in range(0, len(world), group_size)
    ]


def node_coordinator(config: GroupConfig, group_size: int | None = None) -> Coordinator | Replicas:
    """One coordinator over every device, or `Replicas` of groups of `group_size` ranks."""
    configs = split_group(config, group_size or len(config.world()))
    return Coordinator(configs[0]) if len(configs) == 1 else Replicas(configs)


class Replicas:
    """Several worker groups behind one `submit`; the least busy group gets each request."""

    def __init__(self, configs: Sequence[GroupConfig]) -> None:
        if not configs:
            raise ValueError("replicas need at least one group")
        self.configs = list(configs)
        self.coordinators = [Coordinator(config) for config in self.configs]
        self._lock = threading.Lock()
        self._outstanding = [0] * len(self.coordinators)  # submitted, future not yet done
        self._where: dict[str, int] = {}  # request id -> group, while outstanding

    def start(self) -> None:
        """Start every group at once; if one fails, stop the others and raise its error."""
        settings = self.configs[0].settings or GpuWorkerSettings()
        for spec in set(self.configs[0].pipelines.values()):
            # Once, here: groups starting together would otherwise each build the same cache.
            prepare_pipeline(spec, settings)
        errors: list[BaseException | None] = [None] * len(self.coordinators)

        def start_one(index: int) -> None:
            try:
                self.coordinators[index].start()
            except BaseException as exc:  # handed to the caller below
                errors[index] = exc

        threads = [
            threading.Thread(target=start_one, args=(i,), name=f"kiln-start-g{i}")
            for i in range(len(self.coordinators))
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failed = next((error for error in errors if error is not None), None)
        if failed is not None:
            self.shutdown()
            raise failed

    def submit(
        self,
        request: GenerationRequest,
        on_progress: Callable[[StepProgress], None] | None = None,
        should_stop: ShouldStop | None = None,
        max_run_seconds: float | None = None,
        on_checkpoint: Callable[[StepCheckpoint], None] | None = None,
    ) -> Future[GenerationResult]:
        """Queue a request on the least busy group; the future is that group's."""
        request_id = request.request_id
        # Read before taking the lock: a coordinator may resolve a future (whose callback takes
        # this lock) while holding its own, so this lock is never held waiting for theirs.
        alive = [bool(c.stats()["group_alive"]) for c in self.coordinators]
        with self._lock:
            if request_id in self._where:
                raise ValueError(f"request {request_id} is already queued or running")
            index = self._least_busy(alive)
            self._outstanding[index] += 1
            self._where[request_id] = index
        try:
            future = self.coordinators[index].submit(
                request, on_progress, should_stop, max_run_seconds, on_checkpoint
            )
        except BaseException:
            self._finished(index, request_id)
            raise
        future.add_done_callback(lambda _: self._finished(index, request_id))
        return future

    def set_batch_start(self, batch_start: BatchStart | None) -> None:
        """Every group asks `batch_start` which requests of its batches start (Coordinator's)."""
        for coordinator in self.coordinators:
            coordinator.set_batch_start(batch_start)

    def _least_busy(self, alive: list[bool]) -> int:
        # A group being rebuilt is passed over while another is up; its queue would wait.
        candidates = [i for i, up in enumerate(alive) if up] or list(range(len(alive)))
        return min(candidates, key=lambda i: (self._outstanding[i], i))

    def _finished(self, index: int, request_id: str) -> None:
        with self._lock:
            if self._where.pop(request_id, None) is not None:
                self._outstanding[index] -= 1

    def pipelines(self) -> list[str]:
        """Names of the pipelines every group serves."""
        return self.coordinators[0].pipelines()

    def pipeline_limits(self) -> dict[str, DeclaredLimits]:
        """What each pipeline declares (every group loads the same pipelines)."""
        return self.coordinators[0].pipeline_limits()

    def pipeline_inputs(self) -> dict[str, InputSchema]:
        """Input schemas of the pipelines that declare one (alike in every group)."""
        return self.coordinators[0].pipeline_inputs()

    def take_charge(self, request_id: str) -> tuple[float, float | None]:
        """A finished request's GPU-seconds and joules, from the group that ran it."""
        gpu_s, energy_j = 0.0, None
        for coordinator in self.coordinators:  # one of them held it; the others answer 0
            seconds, joules = coordinator.take_charge(request_id)
            gpu_s += seconds
            if joules is not None:
                energy_j = (energy_j or 0.0) + joules
        return gpu_s, energy_j

    def counters(self) -> GroupCounters:
        """Every group's work counters added up, for the node's metrics."""
        return GroupCounters.merged([c.counters() for c in self.coordinators])

    def stats(self) -> dict[str, Any]:
        """The groups' counters added up, and each group's own under `groups`."""
        groups = [coordinator.stats() for coordinator in self.coordinators]
        progress = [g["last_progress_at"] for g in groups if g["last_progress_at"] is not None]
        with self._lock:
            outstanding = list(self._outstanding)
        for group, count in zip(groups, outstanding, strict=True):
            group["outstanding"] = count
        return {
            "jobs_queued": sum(g["jobs_queued"] for g in groups),
            "jobs_running": sum(g["jobs_running"] for g in groups),
            "last_progress_at": max(progress, default=None),
            "rebuilds": sum(g["rebuilds"] for g in groups),
            "batches_run": sum(g["batches_run"] for g in groups),
            "group_alive": all(g["group_alive"] for g in groups),
            "world_size": sum(g["world_size"] for g in groups),
            "pids": [pid for g in groups for pid in g["pids"]],
            "pipelines": self.pipelines(),
            "group_size": groups[0]["world_size"],
            "groups": groups,
        }

    def shutdown(self) -> None:
        """Shut every group down at once (each fails what it still holds); idempotent."""
        threads = [
            threading.Thread(target=c.shutdown, name=f"kiln-stop-g{i}")
            for i, c in enumerate(self.coordinators)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
