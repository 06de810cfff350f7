"""The group's devices' energy counter, through NVML where there is one (kiln/common/ledger.py).

NVIDIA GPUs since Volta count the energy they used in millijoules since the driver loaded
(`nvmlDeviceGetTotalEnergyConsumption`); a forward's energy is the counter's rise over it. It is
read only where every rank is a CUDA device and `pynvml` imports (NVIDIA's `nvidia-ml-py`, which
Kiln's `worker` extra installs); anywhere else (CPU ranks, another vendor, no NVML driver)
`read_j` is None and so is every job's `energy_j`. A `cuda:N` device is NVML's device N: with
CUDA_VISIBLE_DEVICES set, CUDA's numbering may differ from NVML's, so the figure then is another
device's (docs/operations.md §21).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)


class EnergyMeter:
    """The summed energy counter of a group's devices, in joules; None where not measurable."""

    def __init__(self, world: Sequence[str]) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        if not world or not all(device.startswith("cuda") for device in world):
            return
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            indexes = sorted({int(device.partition(":")[2] or "0") for device in world})
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in indexes]
            self._nvml = nvml
        except Exception as exc:  # not installed, no driver, no counter: no energy figures
            logger.info("no NVML energy counter for %s: %s", list(world), exc)
            self._handles = []

    def read_j(self) -> float | None:
        """The devices' energy counters summed, in joules; None when not measured."""
        if self._nvml is None:
            return None
        try:
            millijoules = sum(
                int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles
            )
        except Exception as exc:  # an older GPU without the counter: no energy from now on
            logger.info("NVML energy counter unreadable: %s", exc)
            self._nvml = None
            return None
        return millijoules / 1000.0
