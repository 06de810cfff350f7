"""What a node's heartbeat says of its LoRA adapters, per pipeline it serves.

`available`: the adapters under the node's adapters folder for that pipeline (read from disk at
each heartbeat, so an adapter copied in is offered without a restart); `loaded` and `fused`: what
the ranks hold now, as rank 0 reported after its last forward (with replica groups, the union
over the groups). Every served pipeline is listed, so the API can tell "no such adapter" from "a
node too old to say".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kiln.gpu_worker.pipelines.lora import available_adapters


def heartbeat_adapters(
    pipelines: Iterable[str], lora_dir: Path | None, stats: Mapping[str, Any]
) -> dict[str, dict[str, list[str]]]:
    """Per pipeline: the adapters available, loaded and fused; `stats` is the coordinator's."""
    held = _held_by_pipeline(stats)
    announced: dict[str, dict[str, list[str]]] = {}
    for pipeline in sorted(pipelines):
        loaded, fused = held.get(pipeline, (set(), set()))
        announced[pipeline] = {
            "available": available_adapters(lora_dir, pipeline),
            "loaded": sorted(loaded),
            "fused": sorted(fused),
        }
    return announced


def _held_by_pipeline(stats: Mapping[str, Any]) -> dict[str, tuple[set[str], set[str]]]:
    """Loaded and fused adapter names per pipeline, over every group in `stats`."""
    groups = stats.get("groups") or [stats]  # replica groups report one stats dict each
    held: dict[str, tuple[set[str], set[str]]] = {}
    for group in groups:
        for pipeline, state in (group.get("adapters") or {}).items():
            loaded, fused = held.setdefault(str(pipeline), (set(), set()))
            loaded.update(str(name) for name in state.get("loaded", ()))
            fused.update(str(name) for name in state.get("fused", ()))
    return held
