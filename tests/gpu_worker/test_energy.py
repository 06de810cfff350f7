"""Which NVML device a `cuda:N` rank's energy is read from (gpu_worker/energy.py).

No GPU here: NVML is a stand-in with the calls energy.py makes, over a node of four GPUs.
What is under test is Kiln's mapping from CUDA's numbering (CUDA_VISIBLE_DEVICES) to NVML's.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import pytest

from kiln.gpu_worker.energy import EnergyMeter, nvml_device


@dataclass
class Gpu:
    uuid: str
    name: str
    millijoules: int


class StandInNvml:
    """The NVML calls energy.py makes, over `gpus` in NVML's (PCI bus) order."""

    def __init__(self, gpus: list[Gpu]) -> None:
        self.gpus = gpus

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Gpu:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Gpu:
        (gpu,) = [gpu for gpu in self.gpus if gpu.uuid == uuid]
        return gpu

    def nvmlDeviceGetUUID(self, handle: Gpu) -> bytes:
        return handle.uuid.encode()  # older bindings answer bytes

    def nvmlDeviceGetName(self, handle: Gpu) -> str:
        return handle.name

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Gpu) -> int:
        return handle.millijoules


def node(models: tuple[str, ...] = ("H100",) * 4) -> StandInNvml:
    return StandInNvml(
        [
            Gpu(f"GPU-{n}{n}{n}{n}aaaa-0000-0000-0000-00000000000{n}", model, (n + 1) * 1000)
            for n, model in enumerate(models)
        ]
    )


def test_without_renumbering_cuda_n_is_nvml_n() -> None:
    nvml = node()
    assert nvml_device(nvml, 2, {}) is nvml.gpus[2]


def test_visible_devices_by_index_are_renumbered_from_zero() -> None:
    nvml = node()
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert [nvml_device(nvml, n, env) for n in (0, 1)] == [nvml.gpus[2], nvml.gpus[3]]


def test_visible_devices_by_uuid_prefix_name_their_gpu() -> None:
    nvml = node()
    env = {"CUDA_VISIBLE_DEVICES": "GPU-3333, GPU-1111aaaa"}
    assert [nvml_device(nvml, n, env) for n in (0, 1)] == [nvml.gpus[3], nvml.gpus[1]]
    with pytest.raises(ValueError, match="names 4 of this node's GPUs"):
        nvml_device(nvml, 0, {"CUDA_VISIBLE_DEVICES": "GPU-"})  # not unique
    with pytest.raises(IndexError):
        nvml_device(nvml, 1, {"CUDA_VISIBLE_DEVICES": "0"})  # cuda:1 is not visible


def test_mixed_models_in_cudas_default_order_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    mixed = node(("H100", "A100", "H100", "A100"))
    with caplog.at_level(logging.WARNING, logger="kiln.gpu_worker.energy"):
        assert nvml_device(mixed, 0, {"CUDA_VISIBLE_DEVICES": "1"}) is mixed.gpus[1]
        nvml_device(mixed, 1, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})  # the orders agree: quiet
        nvml_device(node(), 1, {})  # one model: quiet
    assert len(caplog.records) == 1
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in caplog.records[0].getMessage()


def test_a_groups_energy_is_its_own_gpus_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", node())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    meter = EnergyMeter(["cuda:0", "cuda:1"])
    assert meter.read_j() == (2000 + 4000) / 1000  # NVML's devices 1 and 3, not 0 and 1
    assert EnergyMeter(["cpu:0", "cuda:0"]).read_j() is None  # not every rank a GPU
