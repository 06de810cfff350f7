"""Kiln's GPU worker: a rank-0 led torch.distributed group that runs generation pipelines.

The public names below are imported lazily (PEP 562), so `import gpu_worker.errors` or
`gpu_worker.protocol` does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_worker.config import GroupConfig
    from gpu_worker.coordinator import Coordinator
    from gpu_worker.errors import (
        DeadlineExceeded,
        GpuWorkerError,
        JobFailed,
        JobStopped,
        OutOfMemory,
        RankStartupFailed,
        UnsupportedRequest,
        WorkerGroupDied,
    )
    from gpu_worker.group import WorkerGroup
    from gpu_worker.parallel import ParallelSpec
    from gpu_worker.protocol import GenerationRequest, GenerationResult, Progress, RunMetrics

_EXPORTS = {
    "Coordinator": "gpu_worker.coordinator",
    "GroupConfig": "gpu_worker.config",
    "WorkerGroup": "gpu_worker.group",
    "ParallelSpec": "gpu_worker.parallel",
    "GenerationRequest": "gpu_worker.protocol",
    "GenerationResult": "gpu_worker.protocol",
    "Progress": "gpu_worker.protocol",
    "RunMetrics": "gpu_worker.protocol",
    "GpuWorkerError": "gpu_worker.errors",
    "JobFailed": "gpu_worker.errors",
    "UnsupportedRequest": "gpu_worker.errors",
    "OutOfMemory": "gpu_worker.errors",
    "DeadlineExceeded": "gpu_worker.errors",
    "JobStopped": "gpu_worker.errors",
    "WorkerGroupDied": "gpu_worker.errors",
    "RankStartupFailed": "gpu_worker.errors",
}

__all__ = [
    "Coordinator",
    "DeadlineExceeded",
    "GenerationRequest",
    "GenerationResult",
    "GpuWorkerError",
    "GroupConfig",
    "JobFailed",
    "JobStopped",
    "OutOfMemory",
    "ParallelSpec",
    "Progress",
    "RankStartupFailed",
    "RunMetrics",
    "UnsupportedRequest",
    "WorkerGroup",
    "WorkerGroupDied",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
