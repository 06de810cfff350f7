"""A node's LoRA adapters: where they come from, and what its heartbeat says of them.

Two sources, per pipeline: the node's adapters folder (`--lora-dir`, read from disk at each
heartbeat, so an adapter copied in is offered without a restart) and, with `KILN_LORA_PREFIX`
set, objects in the store under `[<store prefix>/]<lora prefix>/<pipeline>/<name>/
pytorch_lora_weights.safetensors` (listed at most every `KILN_LORA_LIST_INTERVAL_S`). A store
adapter is fetched on its first use, before the job reaches the ranks: downloaded, checked
against the sha256 the store keeps, and renamed into `<model cache>/lora-store` in the layout the
ranks read (`gpu_worker/pipelines/lora.py`), so they load it as they load a local one. A name in
both sources is the local one. An adapter is fetched once per machine: to change one, give the
new weights a new name.

The heartbeat lists, per served pipeline, the adapters `available` from either source, and those
the ranks hold now (`loaded`, `fused`), as rank 0 reported after its last forward (with replica
groups, the union over the groups). Every served pipeline is listed, so the API can tell "no such
adapter" from "a node too old to say".
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from kiln.gpu_worker.errors import JobFailed
from kiln.gpu_worker.pipelines.lora_folders import (
    ADAPTER_WEIGHTS,
    available_adapters,
    find_adapter,
    store_adapter_cache,
)
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.storage.errors import ObjectStoreError
from kiln.storage.local_store import write_atomically
from kiln.storage.object_base import ObjectStore, check_prefix
from kiln.tasks.contract.loras import AdapterName

log = logging.getLogger(__name__)

_ADAPTER_NAME: TypeAdapter[str] = TypeAdapter(AdapterName)


def store_adapter_folder(objects: ObjectStore, lora_prefix: str, pipeline: str) -> str:
    """The key folder of `pipeline`'s adapters in the store."""
    folder = f"{lora_prefix}/{pipeline}"
    return f"{objects.prefix}/{folder}" if objects.prefix else folder


class StoreAdapters:
    """The adapters kept in the object store under one prefix: listed, and fetched on first use."""

    def __init__(
        self,
        objects: ObjectStore,
        lora_prefix: str,
        cache: Path,
        list_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._objects = objects
        self._prefix = lora_prefix
        self._cache = cache
        self._interval = list_interval_s
        self._clock = clock
        self._listed: dict[str, tuple[float, list[str]]] = {}  # pipeline -> (when, names)
        self._fetching = threading.Lock()  # one download at a time: no two of the same file

    def names(self, pipeline: str) -> list[str]:
        """The adapters of `pipeline` in the store, as last listed (again when that is old)."""
        listed = self._listed.get(pipeline)
        if listed is not None and self._clock() - listed[0] < self._interval:
            return listed[1]
        try:
            names = self._list(pipeline)
        except ObjectStoreError as exc:  # the heartbeat goes on with what it knew
            log.warning("listing the store's adapters of %s failed: %s", pipeline, exc)
            return listed[1] if listed is not None else []
        self._listed[pipeline] = (self._clock(), names)
        return names

    def _list(self, pipeline: str) -> list[str]:
        folder = store_adapter_folder(self._objects, self._prefix, pipeline)
        names = set()
        for key in self._objects.list_keys(folder):
            name, _, rest = key.removeprefix(folder + "/").partition("/")
            if rest == ADAPTER_WEIGHTS and _is_adapter_name(name):
                names.add(name)
        return sorted(names)

    def fetch(self, pipeline: str, name: str) -> None:
        """Download adapter `name` into the cache unless it is there; no-op if the store lacks it.

        A missing adapter is left to the ranks to refuse, naming it, like a local one.
        """
        if find_adapter([self._cache], pipeline, name) is not None:
            return  # fetched before: the usual case, no lock taken
        with self._fetching:
            if find_adapter([self._cache], pipeline, name) is not None:
                return  # another job fetched it while this one waited
            key = f"{store_adapter_folder(self._objects, self._prefix, pipeline)}/{name}/"
            stored = self._objects.head(key + ADAPTER_WEIGHTS)
            if stored is None:
                return
            data = self._objects.get(stored.key)
            digest = hashlib.sha256(data).hexdigest()
            if stored.sha256 and digest != stored.sha256:
                # as the S3 store's own read check: the stored object is bad, a retry rereads it
                raise JobFailed(f"loras: adapter {name!r} in the store does not match its sha256")
            target = self._cache / pipeline / name / ADAPTER_WEIGHTS
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(target, data)
            log.info(
                "adapter %s/%s fetched (%d bytes, sha256 %s)", pipeline, name, len(data), digest
            )


class AdapterSources:
    """Every adapter a node can offer: its adapters folder, and the store's when configured."""

    def __init__(self, lora_dir: Path | None, store: StoreAdapters | None = None) -> None:
        self.lora_dir = lora_dir
        self.store = store

    @classmethod
    def for_node(cls, settings: GpuWorkerSettings | None, objects: ObjectStore) -> AdapterSources:
        """The sources `settings` name: the lora dir, and the store folder (`lora_prefix`)."""
        settings = settings or GpuWorkerSettings()
        store = None
        if settings.lora_prefix is not None:
            folder = check_prefix(settings.lora_prefix)  # ValueError: the node does not start
            cache = store_adapter_cache(settings)
            store = StoreAdapters(objects, folder, cache, settings.lora_list_interval_s)
        return cls(settings.lora_dir, store)

    def available(self, pipeline: str) -> list[str]:
        """The adapters `pipeline`'s jobs may name here, from either source, sorted."""
        local = available_adapters(self.lora_dir, pipeline)
        stored = self.store.names(pipeline) if self.store is not None else []
        return sorted({*local, *stored})

    def fetch(self, request: GenerationRequest) -> None:
        """Make the request's store adapters ready for the ranks (before it is submitted)."""
        if self.store is None:
            return
        for ref in request.loras:
            local = self.lora_dir and find_adapter([self.lora_dir], request.pipeline, ref.name)
            if not local:  # the folder's own copy wins; only the store's are fetched
                self.store.fetch(request.pipeline, ref.name)

    def heartbeat(
        self, pipelines: Iterable[str], stats: Mapping[str, Any]
    ) -> dict[str, dict[str, list[str]]]:
        """Per pipeline: the adapters available, loaded and fused; `stats` is the coordinator's."""
        held = _held_by_pipeline(stats)
        announced: dict[str, dict[str, list[str]]] = {}
        for pipeline in sorted(pipelines):
            loaded, fused = held.get(pipeline, (set(), set()))
            announced[pipeline] = {
                "available": self.available(pipeline),
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


def _is_adapter_name(name: str) -> bool:
    # Only names a job may give (the contract's pattern): others could never be asked for.
    try:
        _ADAPTER_NAME.validate_python(name)
    except ValidationError:
        return False
    return True
