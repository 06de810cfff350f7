"""A package's names imported on first use (PEP 562): how gpu_worker's packages stay torch-free.

`gpu_worker`, `gpu_worker.parallel` and `gpu_worker.pipelines` export names whose modules import
torch; a node imports those packages for their torch-free parts and must not pay for the rest.
Each declares `__getattr__ = lazy_exports(__name__, {name: module})` under `if not TYPE_CHECKING`,
beside the same names imported under `TYPE_CHECKING`, so that mypy still refuses a misspelled one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `exports[name]` imported when `name` is first read."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
