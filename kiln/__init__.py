"""Kiln: a durable job queue for GPU image and video generation.

The code lives in the top-level folders `tasks/`, `gpu_worker/` and `storage/` (the layout the
project is known by); they install and import as `kiln.tasks`, `kiln.gpu_worker` and
`kiln.storage` through the links in this folder, so Kiln never shadows a user's own `tasks.py`.

What a producer needs is here, torch-free: `from kiln import KilnClient, JobRequest`. The names
load on first use (PEP 562), so `import kiln.tasks...` alone pulls in nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.tasks.client.client import KilnClient, KilnError
    from kiln.tasks.contract.batches import BatchResult, BatchSummary, BatchView
    from kiln.tasks.contract.schemas import JobRequest
    from kiln.tasks.contract.views import JobView

_EXPORTS = {
    "KilnClient": "kiln.tasks.client.client",
    "KilnError": "kiln.tasks.client.client",
    "JobRequest": "kiln.tasks.contract.schemas",
    "JobView": "kiln.tasks.contract.views",
    "BatchResult": "kiln.tasks.contract.batches",  # one line of a batch's results
    "BatchSummary": "kiln.tasks.contract.batches",  # the last line of a finished batch's results
    "BatchView": "kiln.tasks.contract.batches",
}

__all__ = [
    "BatchResult",
    "BatchSummary",
    "BatchView",
    "JobRequest",
    "JobView",
    "KilnClient",
    "KilnError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
