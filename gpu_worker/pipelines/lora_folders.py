"""Where LoRA adapters live on local disk: the layout the node and the ranks share.

`<lora dir>/<pipeline>/<name>/pytorch_lora_weights.safetensors` (the file diffusers'
`save_lora_weights` writes), one folder of adapters per pipeline name, so an adapter is only ever
offered to the pipeline it was made for. Adapters kept in the object store are fetched by the
node on first use into the same layout under `<model cache>/lora-store`
(`tasks/node/adapters.py`); the ranks look there after the lora dir (`lora.py`). Torch-free: the
node lists and fetches adapters, and never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kiln.gpu_worker.settings import GpuWorkerSettings

ADAPTER_WEIGHTS = "pytorch_lora_weights.safetensors"
STORE_CACHE_FOLDER = "lora-store"  # under the model cache: adapters fetched from the store


def adapter_weights(root: Path, pipeline: str, name: str) -> Path:
    """Where adapter `name` of `pipeline` lives under the adapters folder `root`."""
    return root / pipeline / name / ADAPTER_WEIGHTS


def available_adapters(root: Path | None, pipeline: str) -> list[str]:
    """Names of the adapters `pipeline` may use (folders holding a weights file), sorted."""
    if root is None or not (root / pipeline).is_dir():
        return []
    return sorted(
        entry.name
        for entry in (root / pipeline).iterdir()
        if (entry / ADAPTER_WEIGHTS).is_file() and not entry.name.startswith(".")
    )


def store_adapter_cache(settings: GpuWorkerSettings) -> Path:
    """Where the node puts adapters fetched from the object store, for its ranks to load."""
    return settings.model_cache / STORE_CACHE_FOLDER


def find_adapter(roots: Sequence[Path], pipeline: str, name: str) -> Path | None:
    """The weights file of adapter `name` in the first of `roots` holding it; None if none."""
    for root in roots:
        weights = adapter_weights(root, pipeline, name)
        if weights.is_file():
            return weights
    return None
