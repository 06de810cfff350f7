"""`GroupConfig`: one object for everything about a worker group and its coordinator."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kiln.common.defaults import BATCH_WINDOW_S, DEADLINE_GRACE_S, MAX_BATCH
from kiln.gpu_worker.parallel import ParallelSpec
from kiln.gpu_worker.settings import GpuWorkerSettings


@dataclass(frozen=True)
class GroupConfig:
    """A worker group: its devices, resident pipelines, parallelism, batching and timeouts.

    `devices`: "cpu:2" expands to two CPU ranks (gloo); "cuda:0,cuda:1" (or one entry per
    device) to one rank per GPU (nccl). `pipelines` maps the names requests use to load specs.
    `parallel` defaults to `auto`, which is `none` on one rank; `none` on several is refused.
    """

    devices: list[str]
    pipelines: dict[str, str]
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    max_batch: int = MAX_BATCH
    batch_window_s: float = BATCH_WINDOW_S
    node_name: str = "node"
    # Lifecycle; the defaults are for real models (minutes to load, seconds per step).
    ready_timeout_s: float = 300.0
    shutdown_grace_s: float = 10.0
    deadline_grace_s: float = DEADLINE_GRACE_S
    collective_timeout_s: float = 300.0
    desync_grace_s: float = 30.0
    verdict_wait_s: float = 2.0
    cpu_threads_per_rank: int | None = None
    warmup: bool = True
    settings: GpuWorkerSettings | None = None
    # How the ranks log (gpu_worker/logs.py): the node passes its own format and level down.
    log_format: str = "text"
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.pipelines:
            raise ValueError("a worker group needs at least one pipeline")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {self.max_batch}")
        # Fail here, before any rank is spawned: a malformed or absent device, or ranks that
        # would all compute the same thing.
        world = check_devices(self.devices)
        check_parallel(self.parallel, len(world))
        if self.parallel.mode == "auto" and len(world) == 1:
            # One rank has nothing to divide; ranks then log no "runs unsplit" warning either.
            object.__setattr__(self, "parallel", replace(self.parallel, mode="none"))

    @classmethod
    def from_settings(
        cls,
        settings: GpuWorkerSettings,
        devices: list[str],
        pipelines: dict[str, str],
        parallel: ParallelSpec | None = None,
        **options: object,
    ) -> GroupConfig:
        """A config whose lifecycle timeouts and thread count come from `settings`."""
        return cls(
            devices=devices,
            pipelines=pipelines,
            parallel=parallel or ParallelSpec(),
            ready_timeout_s=settings.ready_timeout_s,
            shutdown_grace_s=settings.shutdown_grace_s,
            cpu_threads_per_rank=settings.cpu_threads_per_rank,
            settings=settings,
            **options,  # type: ignore[arg-type]
        )

    def world(self) -> list[str]:
        """One torch device string per rank, in rank order."""
        return expand_devices(self.devices)

    def backend(self) -> str:
        """`nccl` when every rank has a GPU, `gloo` when every rank is a CPU."""
        return backend_for(self.world())

    def threads_per_rank(self) -> int:
        """Torch threads for each rank: the configured number, else the cores shared out."""
        if self.cpu_threads_per_rank is not None:
            return max(1, self.cpu_threads_per_rank)
        return max(1, available_cores() // len(self.world()))


def expand_devices(devices: Sequence[str]) -> list[str]:
    """'cpu:2' -> ['cpu', 'cpu']; 'cuda:0,cuda:1' -> ['cuda:0', 'cuda:1']; 'cpu' -> ['cpu']."""
    world: list[str] = []
    for entry in devices:
        for item in (part.strip() for part in entry.split(",")):
            kind, _, index = item.partition(":")
            if kind == "cpu" and (index.isdigit() or not index):
                count = int(index) if index else 1
                if count < 1:
                    raise ValueError(f"device {item!r}: need at least one CPU rank")
                world.extend(["cpu"] * count)
            elif kind == "cuda" and index.isdigit():
                world.append(f"cuda:{int(index)}")
            else:
                raise ValueError(f"device {item!r}: expected cpu, cpu:<ranks> or cuda:<index>")
    if not world:
        raise ValueError("a worker group needs at least one device")
    if len({d for d in world if d != "cpu"}) != sum(1 for d in world if d != "cpu"):
        raise ValueError(f"devices {devices}: a GPU appears twice")
    backend_for(world)
    return world


def check_devices(devices: Sequence[str]) -> list[str]:
    """`expand_devices`, also refusing a CUDA device this torch build or machine does not have."""
    world = expand_devices(devices)
    wanted = [int(device.split(":")[1]) for device in world if device.startswith("cuda:")]
    if not wanted:
        return world
    import torch  # only here: a CPU node never imports torch (its ranks do), 1.6 CPU s saved

    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"cuda:{wanted[0]} asked for, but this torch build ({torch.__version__}) has no CUDA; "
            "use cpu:<ranks>, or install a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    missing = [index for index in wanted if index >= count]
    if missing:
        seen = ", ".join(f"cuda:{index}" for index in range(count)) or "none"
        raise ValueError(f"cuda:{missing[0]} asked for, but the visible CUDA devices are: {seen}")
    return world


def check_parallel(spec: ParallelSpec, ranks: int) -> None:
    """Refuse `none` on several ranks: each would compute every job in full, for nothing."""
    if spec.mode == "none" and ranks > 1:
        raise ValueError(
            f"parallel mode 'none' on {ranks} ranks makes every rank compute every job in full; "
            "use 'auto' (the default), 'batch' or 'context', or a single device"
        )


def backend_for(world: Sequence[str]) -> str:
    """The torch.distributed backend of the tensor collectives for these devices."""
    kinds = {device.split(":")[0] for device in world}
    if kinds == {"cpu"}:
        return "gloo"
    if kinds == {"cuda"}:
        return "nccl"
    raise ValueError(f"devices {list(world)}: CPU and GPU ranks cannot be mixed in one group")


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
