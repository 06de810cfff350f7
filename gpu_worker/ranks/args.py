"""What a rank process is started with: its arguments and the OS handles it is given.

The node builds both (gpu_worker/group_spawn.py) and multiprocessing pickles them into the rank.
Here, not beside the rank's start (`ranks.start`): the node imports no torch, and importing the
ranks' code would load it and every pipeline library (diffusers, transformers, peft) into a node
whose ranks come from the rank server, which has them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kiln.gpu_worker.parallel.spec import ParallelSpec
from kiln.gpu_worker.settings import GpuWorkerSettings


@dataclass(frozen=True)
class RankArgs:
    """Node -> rank, at its start: everything it needs; pickled once into the rank's process."""

    rank: int
    world_size: int
    device: str
    backend: str
    store_port: int
    pipelines: dict[str, str]
    parallel: ParallelSpec
    node_name: str
    threads: int
    parent_pid: int
    collective_timeout_s: float
    verdict_wait_s: float
    warmup: bool
    settings: GpuWorkerSettings | None = None
    log_format: str = "text"
    log_level: str = "INFO"


@dataclass
class RankPipes:
    """The rank's pipes: status (every rank), commands/results (rank 0), death (read end).

    And rank 0's `store_listener`: the listening socket the node bound for the group's store.
    """

    status: Connection
    death: Connection
    commands: Connection | None = None
    results: Connection | None = None
    store_listener: socket.socket | None = None
