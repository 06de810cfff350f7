"""A batched forward's GPU-seconds charged to its requests by their work (kiln/common/ledger.py).

A real coordinator on two CPU ranks (one group of two devices) with the tiny pipeline: requests
submitted together share a forward; each is charged its outputs' part of the forward's
seconds × 2, and the charges add up to the group's busy GPU-seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from kiln.gpu_worker.coordinator import Coordinator
from tests.gpu_worker.conftest import GENEROUS_S, request
from tests.gpu_worker.fixtures import spec


def test_a_batch_s_seconds_times_devices_are_shared_by_outputs(
    coordinator_factory: Callable[..., Coordinator],
) -> None:
    coordinator = coordinator_factory(
        "cpu:2", {"base": spec("base")}, max_batch=4, batch_window_s=0.5
    )
    outputs = {"one": 1, "two": 2, "also-one": 1}
    futures = [
        coordinator.submit(request(request_id, num_outputs=count))
        for request_id, count in outputs.items()
    ]
    for future in futures:
        future.result(GENEROUS_S)
    counters = coordinator.counters()
    assert counters.devices == 2
    assert counters.batch_sizes == {4: 1}  # one forward of the four outputs
    charges = {request_id: coordinator.take_charge(request_id) for request_id in outputs}
    gpu_s = {request_id: seconds for request_id, (seconds, _) in charges.items()}
    assert all(joules is None for _, joules in charges.values())  # CPU ranks: no NVML
    assert math.fsum(gpu_s.values()) == pytest.approx(counters.busy_gpu_s, rel=1e-9)
    assert counters.busy_gpu_s == pytest.approx(2 * counters.busy_s, rel=1e-9)
    assert gpu_s["two"] == pytest.approx(2 * gpu_s["one"], rel=1e-9)
    assert gpu_s["one"] == pytest.approx(gpu_s["also-one"], rel=1e-9)
    # held: the two devices since the group was ready, the busy time among it
    assert counters.held_gpu_s > counters.busy_gpu_s > 0
    assert coordinator.take_charge("one") == (0.0, None)  # taken once
