"""A job's LoRA adapters (`loras`): the item model, and the adapters live nodes announce.

A node announces, per pipeline it serves, the adapters it can load (`available`) and those its
ranks hold now (`loaded`, `fused`), under `adapters` in its heartbeat. The API accepts an adapter
name some live node serving the pipeline announces; while no live node serves the pipeline it
cannot tell, and the job waits in its queue like any other (a node that lacks the adapter then
fails the job, naming it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_LORAS = 4
MAX_LORA_SCALE = 8.0
ERROR_TYPE = "unknown_adapter"
# Key-safe: it names a folder on the node and a PEFT adapter (no dots: they split module paths).
AdapterName = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_\-]*$")
]


class LoraSpec(BaseModel):
    """One LoRA adapter a job applies, by name, at a scale (0 = no effect)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: AdapterName = Field(description="An adapter GET /v1/pipelines/{name} lists.")
    scale: float = Field(
        default=1.0,
        strict=True,
        ge=-MAX_LORA_SCALE,
        le=MAX_LORA_SCALE,
        allow_inf_nan=False,
        description="How strongly the adapter applies; 1 = as trained, 0 = not at all.",
    )


def check_unique(loras: Sequence[LoraSpec]) -> None:
    """Refuse an adapter named twice (its two scales would silently add up)."""
    names = [lora.name for lora in loras]
    if len(set(names)) != len(names):
        raise ValueError("an adapter must not be named twice")


@dataclass(frozen=True)
class NodeAdapters:
    """One pipeline's adapters on one node, as its heartbeat announces them."""

    node_id: str
    available: tuple[str, ...] = ()
    loaded: tuple[str, ...] = ()
    fused: tuple[str, ...] = ()


def announced_adapters(node: Mapping[str, Any]) -> dict[str, NodeAdapters]:
    """Per pipeline a node serves, the adapters its heartbeat announces (malformed: none)."""
    announced = node.get("adapters")
    if not isinstance(announced, Mapping):
        return {}
    served = {str(name) for name in node.get("pipelines", [])}
    node_id = str(node.get("node_id", ""))
    found: dict[str, NodeAdapters] = {}
    for pipeline, entry in announced.items():
        if str(pipeline) in served and isinstance(entry, Mapping):
            found[str(pipeline)] = NodeAdapters(
                node_id,
                *(_names(entry.get(part)) for part in ("available", "loaded", "fused")),
            )
    return found


def _names(value: object) -> tuple[str, ...]:
    return tuple(str(name) for name in value) if isinstance(value, list) else ()


@dataclass(frozen=True)
class AdapterViolation:
    """A job names an adapter no live node serving its pipeline announces."""

    kind: ClassVar[str] = ERROR_TYPE
    pipeline: str
    index: int
    name: str
    known: tuple[str, ...]

    @property
    def message(self) -> str:
        """What the caller reads."""
        known = ", ".join(self.known) or "none"
        return f"no adapter {self.name!r} for pipeline {self.pipeline}; available: {known}"

    @property
    def value(self) -> str:
        """The offending input: the adapter's name."""
        return self.name

    def loc(self, prefix: tuple[str | int, ...] = ()) -> tuple[str | int, ...]:
        """Where the error points: `loras[i].name`, after `prefix`."""
        return (*prefix, "loras", self.index, "name")

    def context(self) -> dict[str, Any]:
        """The error's `ctx`: the pipeline, and the adapters its live nodes offer."""
        return {"pipeline": self.pipeline, "known": list(self.known)}


def first_adapter_violation(
    pipeline: str, nodes: Sequence[NodeAdapters], loras: Sequence[LoraSpec]
) -> AdapterViolation | None:
    """The first adapter of `loras` that no node in `nodes` offers; None when all are offered.

    `nodes` are the live nodes serving `pipeline`; with none, nothing can be checked yet.
    """
    if not loras or not nodes:
        return None
    known = sorted({name for node in nodes for name in node.available})
    for index, lora in enumerate(loras):
        if lora.name not in known:
            return AdapterViolation(pipeline, index, lora.name, tuple(known))
    return None


def adapter_listing(nodes: Sequence[NodeAdapters]) -> list[dict[str, Any]]:
    """Per adapter name (sorted), the node ids that offer it, hold it loaded and keep it fused."""
    names = sorted({name for node in nodes for name in (*node.available, *node.loaded)})
    return [
        {
            "name": name,
            "available_on": sorted(n.node_id for n in nodes if name in n.available),
            "loaded_on": sorted(n.node_id for n in nodes if name in n.loaded),
            "fused_on": sorted(n.node_id for n in nodes if name in n.fused),
        }
        for name in names
    ]
