"""What submission may name, read from the nodes' heartbeats and kept for a moment.

The pipelines configured, and those live nodes announce with their limits, input schemas and
adapters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.common.request import InputSchema
from kiln.storage.nodes import NodeOps
from kiln.tasks.contract.inputs import announced_inputs
from kiln.tasks.contract.limits import PipelineLimits, announced_limits
from kiln.tasks.contract.loras import NodeAdapters, announced_adapters

# how long one read of the heartbeats answers for (a node starting or leaving shows this late)
KNOWN_PIPELINES_CACHE_S = 2.0


@dataclass(frozen=True)
class Served:
    """What submission may name: pipeline names, and per name the limits live nodes announce."""

    names: list[str] = field(default_factory=list)
    live: frozenset[str] = frozenset()  # names that some live node serves (heartbeats only)
    limits: dict[str, list[PipelineLimits]] = field(default_factory=dict)
    inputs: dict[str, list[InputSchema]] = field(default_factory=dict)  # per name, as announced
    adapters: dict[str, list[NodeAdapters]] = field(default_factory=dict)  # likewise


def served_now(store: NodeOps, configured: Sequence[str]) -> Served:
    """What the live nodes announce now, plus the `configured` pipeline names."""
    live: set[str] = set()
    limits: dict[str, list[PipelineLimits]] = {}
    inputs: dict[str, list[InputSchema]] = {}
    adapters: dict[str, list[NodeAdapters]] = {}
    for node in store.live_nodes():
        live.update(str(p) for p in node.get("pipelines", []))
        for name, announced in announced_limits(node).items():
            limits.setdefault(name, []).append(announced)
        for name, schema in announced_inputs(node).items():
            inputs.setdefault(name, []).append(schema)
        for name, entry in announced_adapters(node).items():
            adapters.setdefault(name, []).append(entry)
    names = live | set(configured)
    return Served(sorted(names), frozenset(live), limits, inputs, adapters)


class ServedCache:
    """`served_now`, read again once `KNOWN_PIPELINES_CACHE_S` has passed."""

    def __init__(self, store: NodeOps, configured: Sequence[str]) -> None:
        self.store = store
        self.configured = list(configured)
        self._read: tuple[float, Served] = (0.0, Served())  # (when read, what it said)

    def is_fresh(self) -> bool:
        """Whether `now()` answers without reading Redis."""
        return time.monotonic() - self._read[0] < KNOWN_PIPELINES_CACHE_S

    def now(self) -> Served:
        """What is served, as last read if that is fresh enough."""
        if self.is_fresh():
            return self._read[1]
        served = served_now(self.store, self.configured)
        self._read = (time.monotonic(), served)
        return served
