"""`kiln worker --group-size`: checked with the other group options before anything starts."""

from __future__ import annotations

import pytest

from kiln.tasks.node.worker import WorkerOptions, _whole_node_parallel

TINY = {"tiny": "tiny"}


def test_the_devices_must_split_into_groups_of_that_size() -> None:
    with pytest.raises(ValueError, match=r"^--group-size 3: 2 device\(s\) do not split"):
        WorkerOptions(pipelines=TINY, devices="cpu:2", group_size=3)
    with pytest.raises(ValueError, match=r"^--group-size 0"):
        WorkerOptions(pipelines=TINY, devices="cpu:2", group_size=0)


def test_parallel_modes_are_judged_per_group() -> None:
    # `none` on one-rank groups is what each group runs anyway.
    options = WorkerOptions(pipelines=TINY, devices="cpu:2", parallel="none", group_size=1)
    assert _whole_node_parallel(options) == "auto"  # the node's config over both devices
    with pytest.raises(ValueError, match=r"^--parallel none"):
        WorkerOptions(pipelines=TINY, devices="cpu:4", parallel="none", group_size=2)
    grouped = WorkerOptions(pipelines=TINY, devices="cpu:4", parallel="batch", group_size=2)
    assert _whole_node_parallel(grouped) == "batch"
