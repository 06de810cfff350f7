"""Completeness of a saved pipeline folder in a cache: a manifest of every file, written last.

A diffusers folder saved by `save_pretrained` has a `model_index.json` even when a component's
weights are missing (transformers saves weights only on distributed rank 0; a crash can cut a
save short). So a folder counts as complete only when its manifest exists and every file it
lists is there with the recorded size, and the manifest is written only after checking that
each model component has its weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = ".kiln-complete.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


class IncompleteSave(RuntimeError):
    """A freshly saved pipeline folder lacks files it must have."""


def seal_cache_folder(folder: Path) -> None:
    """Check every model component has weights, then write the manifest (last, atomically)."""
    missing = components_without_weights(folder)
    if missing:
        raise IncompleteSave(
            f"{folder}: no weights saved for {', '.join(missing)} (was it saved inside a "
            "torch.distributed group on a rank other than 0?)"
        )
    sizes = {
        str(path.relative_to(folder)): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    partial = folder / f"{MANIFEST}.partial"
    partial.write_text(json.dumps(sizes, indent=0))
    os.replace(partial, folder / MANIFEST)


def cache_folder_is_complete(folder: Path) -> bool:
    """True when `folder` has a manifest and every listed file has its recorded size."""
    try:
        sizes = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(sizes, dict) or not sizes:
        return False
    for name, size in sizes.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def components_without_weights(folder: Path) -> list[str]:
    """Names of the components of a diffusers folder that have a model config but no weights."""
    missing = []
    for component in sorted(path for path in folder.iterdir() if path.is_dir()):
        has_model_config = (component / "config.json").is_file()
        has_weights = any(
            path.suffix in WEIGHT_SUFFIXES and path.stat().st_size > 0
            for path in component.iterdir()
        )
        if has_model_config and not has_weights:
            missing.append(component.name)
    return missing
