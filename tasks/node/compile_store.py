"""torch.compile's portable cache artifacts in the object store: a fresh container warms from it.

gpu_worker keeps the compile caches in a folder (gpu_worker/pipelines/compile.py); on a new
machine or an empty volume that folder starts empty and the first start compiles everything.
With `KILN_COMPILE` on, the node therefore, before its group starts, downloads the artifacts file
of its torch version and device kind from `{prefix}/compile-cache/` when its folder has none (the
ranks load it before compiling); and after the group is up (warm-up done, rank 0 wrote the file),
uploads the file when the store's copy is missing or differs. Both are best effort: a store error
is logged and costs a compile, never the start.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

from kiln.gpu_worker.settings import ARTIFACTS_FILE, GpuWorkerSettings
from kiln.storage.errors import StorageError
from kiln.storage.object_base import ObjectStore, check_key

log = logging.getLogger(__name__)

COMPILE_CACHE_FOLDER = "compile-cache"
CONTENT_TYPE = "application/octet-stream"


def compile_cache_key(prefix: str, devices: Sequence[str]) -> str:
    """`{prefix}/compile-cache/torch-<version>-<cpu|cuda>.bin`: artifacts differ by both."""
    import torch  # only with KILN_COMPILE on: a node otherwise never imports torch

    kind = "cuda" if any(device.startswith("cuda") for device in devices) else "cpu"
    version = torch.__version__.replace("+", "-")
    name = f"{COMPILE_CACHE_FOLDER}/torch-{version}-{kind}.bin"
    return check_key(prefix, f"{prefix}/{name}" if prefix else name)


def fetch_compile_cache(
    objects: ObjectStore, settings: GpuWorkerSettings, devices: Sequence[str]
) -> bool:
    """Before the group starts: fill an empty cache folder from the store; True if it did."""
    target = settings.compile_cache() / ARTIFACTS_FILE
    if not settings.compile or target.is_file():
        return False
    key = compile_cache_key(objects.prefix, devices)
    try:
        if objects.head(key) is None:
            return False
        data = objects.get(key)
    except StorageError as exc:
        log.warning("compile cache: cannot read %s (%s); compiling afresh", key, exc)
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.fetch")
    temporary.write_bytes(data)
    temporary.replace(target)
    log.info("compile cache: %d bytes from %s", len(data), key)
    return True


def publish_compile_cache(
    objects: ObjectStore, settings: GpuWorkerSettings, devices: Sequence[str]
) -> bool:
    """After the group is up: upload the folder's artifacts when the store lacks them."""
    source = settings.compile_cache() / ARTIFACTS_FILE
    if not settings.compile or not source.is_file():
        return False
    data = source.read_bytes()
    key = compile_cache_key(objects.prefix, devices)
    try:
        stored = objects.head(key)
        if stored is not None and stored.sha256 == hashlib.sha256(data).hexdigest():
            return False
        objects.put(key, data, CONTENT_TYPE)
    except StorageError as exc:
        log.warning("compile cache: cannot write %s (%s)", key, exc)
        return False
    log.info("compile cache: %d bytes to %s", len(data), key)
    return True
