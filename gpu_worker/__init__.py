"""Kiln's GPU worker: a rank-0 led torch.distributed group that runs generation pipelines.

The public names below are imported lazily (PEP 562), so `import gpu_worker.errors` or
`gpu_worker.protocol` does not pull in torch.

Where things live. The caller's side, in the process that owns the group: `coordinator`
(`Coordinator`: submit, batch, recover) with its collaborators `batching` (the waiting requests),
`inflight` (the batch on the group), `group_slot` (the current group), `tickets` and `failures`;
`group` (`WorkerGroup`, the owner of the rank processes) with `group_spawn` and `group_monitor`,
and `rank_server` (the forkserver the ranks are forked from; `rank_server_boot` is its start).
The ranks' side: `ranks/` (start, leader, follower, one forward), `parallel/` (how a forward is
divided), `pipelines/`. Shared: `protocol` (every message), `config`, `errors`, `limits`, `shm`,
`memory`, `oom_kills`, `settings`; `outputs` encodes frames for the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.gpu_worker.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kiln.gpu_worker.config import GroupConfig
    from kiln.gpu_worker.coordinator import Coordinator
    from kiln.gpu_worker.errors import (
        DeadlineExceeded,
        GpuWorkerError,
        JobFailed,
        JobStopped,
        OutOfMemory,
        RankStartupFailed,
        UnsupportedRequest,
        WorkerGroupDied,
    )
    from kiln.gpu_worker.group import WorkerGroup
    from kiln.gpu_worker.parallel import ParallelSpec
    from kiln.gpu_worker.protocol import (
        GenerationRequest,
        GenerationResult,
        RunMetrics,
        StepProgress,
    )

_EXPORTS = {
    "Coordinator": "kiln.gpu_worker.coordinator",
    "GroupConfig": "kiln.gpu_worker.config",
    "WorkerGroup": "kiln.gpu_worker.group",
    "ParallelSpec": "kiln.gpu_worker.parallel",
    "GenerationRequest": "kiln.gpu_worker.protocol",
    "GenerationResult": "kiln.gpu_worker.protocol",
    "StepProgress": "kiln.gpu_worker.protocol",
    "RunMetrics": "kiln.gpu_worker.protocol",
    "GpuWorkerError": "kiln.gpu_worker.errors",
    "JobFailed": "kiln.gpu_worker.errors",
    "UnsupportedRequest": "kiln.gpu_worker.errors",
    "OutOfMemory": "kiln.gpu_worker.errors",
    "DeadlineExceeded": "kiln.gpu_worker.errors",
    "JobStopped": "kiln.gpu_worker.errors",
    "WorkerGroupDied": "kiln.gpu_worker.errors",
    "RankStartupFailed": "kiln.gpu_worker.errors",
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
    "RankStartupFailed",
    "RunMetrics",
    "StepProgress",
    "UnsupportedRequest",
    "WorkerGroup",
    "WorkerGroupDied",
]


if not TYPE_CHECKING:  # mypy sees the imports above, and so still refuses a misspelled name
    __getattr__ = lazy_exports(__name__, _EXPORTS)
