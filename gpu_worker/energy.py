"""The group's devices' energy counter, through NVML where there is one (kiln/common/ledger.py).

NVIDIA GPUs since Volta count the energy they used in millijoules since the driver loaded
(`nvmlDeviceGetTotalEnergyConsumption`); a forward's energy is the counter's rise over it. It is
read only where every rank is a CUDA device and `pynvml` imports (NVIDIA's `nvidia-ml-py`, which
Kiln's `worker` extra installs); anywhere else (CPU ranks, another vendor, no NVML driver)
`read_j` is None and so is every job's `energy_j`.

A `cuda:N` device is CUDA's N-th visible device, which is NVML's device N only when nothing
renumbers them: `nvml_device` maps it through `CUDA_VISIBLE_DEVICES` (indexes or `GPU-`/`MIG-`
UUIDs, as CUDA reads it). NVML numbers devices by PCI bus; CUDA does too with
`CUDA_DEVICE_ORDER=PCI_BUS_ID`, and by default puts the fastest first, the same order on a node
of one GPU model. On a node of mixed models without that setting the mapping may be off: the
meter warns so.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping, Sequence
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
            ordinals = sorted({int(device.partition(":")[2] or "0") for device in world})
            self._handles = [nvml_device(nvml, ordinal, os.environ) for ordinal in ordinals]
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


def nvml_device(nvml: Any, ordinal: int, env: Mapping[str, str]) -> Any:
    """NVML's handle of CUDA's visible device `ordinal` (`cuda:<ordinal>`), as `env` numbers it.

    Raises (IndexError, ValueError, NVML's errors) where it cannot tell: no energy figures then.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        entry = str(ordinal)
    else:
        # CUDA reads the list up to its first invalid entry; an empty one hides every device
        entries = [part.strip() for part in visible.split(",") if part.strip()]
        entry = entries[ordinal]
    if entry.startswith(("GPU-", "MIG-")):  # a UUID, or its unique prefix, as CUDA accepts it
        return nvml.nvmlDeviceGetHandleByUUID(_full_uuid(nvml, entry))
    index = int(entry)
    if env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and _mixed_models(nvml):
        logger.warning(
            "CUDA orders these GPUs fastest first, NVML by PCI bus: cuda:%d's energy may be "
            "another GPU's (set CUDA_DEVICE_ORDER=PCI_BUS_ID)",
            ordinal,
        )
    return nvml.nvmlDeviceGetHandleByIndex(index)


def _full_uuid(nvml: Any, prefix: str) -> str:
    """The one NVML device UUID `prefix` starts (CUDA takes a unique prefix, NVML a whole one)."""
    if prefix.startswith("MIG-"):
        return prefix  # a MIG instance's UUID: NVML takes it whole, as CUDA needs it whole
    uuids = [
        _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))
        for index in range(nvml.nvmlDeviceGetCount())
    ]
    matching = [uuid for uuid in uuids if uuid.startswith(prefix)]
    if len(matching) != 1:
        raise ValueError(f"{prefix!r} names {len(matching)} of this node's GPUs")
    return matching[0]


def _mixed_models(nvml: Any) -> bool:
    """Whether the node's GPUs are of more than one model (CUDA's default order may differ)."""
    names = {
        _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index)))
        for index in range(nvml.nvmlDeviceGetCount())
    }
    return len(names) > 1


def _text(value: str | bytes) -> str:
    # older bindings answer bytes, newer str
    return value.decode() if isinstance(value, bytes) else value
