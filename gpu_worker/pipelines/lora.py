"""Per-request LoRA adapters: a bounded per-rank cache of loaded adapters, applied per batch.

Adapters live on local disk, one folder of adapters per pipeline name (`lora_folders`: the
layout, which the node shares); the ranks look in the lora dir, then where the node put those it
fetched from the object store.

A rank loads an adapter the first time a batch names it (`load_lora_weights(...,
adapter_name=name)`) and keeps it loaded; past `count` adapters or `max_bytes` of adapter files
it unloads the least recently used ones (`delete_adapters`). Before each forward the batch's
adapters are activated with their scales (`set_adapters`); a batch without adapters runs with
them disabled.

Fusing: once `fuse_after` batches in a row ran with the same adapter set, that set is folded into
the base weights (`fuse_lora`), so while it stays hot its forwards pay no adapter cost; the
first batch with another set unfuses it before anything else changes, restoring the exact base
weights (`lora_fusing.py`).

Every rank of a group runs the same batches in the same order, so every rank's cache makes the
same choices: there is nothing to synchronise.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.gpu_worker.errors import JobFailed, UnsupportedRequest
from kiln.gpu_worker.pipelines.lora_folders import (
    ADAPTER_WEIGHTS,
    available_adapters,
    find_adapter,
    store_adapter_cache,
)
from kiln.gpu_worker.pipelines.lora_fusing import FusedWeights
from kiln.gpu_worker.protocol import AdapterRef, AdapterState, GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterLimits:
    """How many adapters, and how many bytes of them, a rank keeps loaded per pipeline."""

    count: int = 8
    max_bytes: int = 2 << 30
    fuse_after: int | None = None  # batches in a row with one adapter set; None = never fuse

    @classmethod
    def from_settings(cls, settings: GpuWorkerSettings) -> AdapterLimits:
        """The limits the `KILN_LORA_*` settings give."""
        return cls(
            count=settings.lora_cache_count,
            max_bytes=int(settings.lora_cache_mb * (1 << 20)),
            fuse_after=settings.lora_fuse_after,
        )


class AdapterCache:
    """The LoRA adapters loaded into one diffusers pipeline on one rank (LRU by count and bytes)."""

    def __init__(
        self,
        pipe: Any,
        root: Path | None,
        limits: AdapterLimits,
        fetched: Path | None = None,
    ) -> None:
        self._pipe = pipe
        # The lora dir first (the operator's own copy wins), then the node's fetched adapters.
        self._roots = tuple(folder for folder in (root, fetched) if folder is not None)
        self._limits = limits
        self._loaded: OrderedDict[str, int] = OrderedDict()  # name -> file bytes, LRU first
        self._fused: tuple[AdapterRef, ...] = ()
        self._fused_weights: FusedWeights | None = None
        self._last: tuple[AdapterRef, ...] = ()
        self._streak = 0  # batches in a row that ran with `_last`
        self._pipeline = ""  # the name requests use for this pipeline, learnt from them

    def check(self, request: GenerationRequest) -> None:
        """Raise `UnsupportedRequest` naming `loras[i].name` for an adapter this rank lacks."""
        if not request.loras:
            return
        if not self._roots or not hasattr(self._pipe, "load_lora_weights"):
            raise UnsupportedRequest(f"loras: pipeline {request.pipeline} takes no adapters here")
        for index, ref in enumerate(request.loras):
            if find_adapter(self._roots, request.pipeline, ref.name) is None:
                known = sorted(
                    {
                        name
                        for root in self._roots
                        for name in available_adapters(root, request.pipeline)
                    }
                )
                raise UnsupportedRequest(
                    f"loras[{index}].name: no adapter {ref.name!r} for {request.pipeline}; "
                    f"available: {known}"
                )
        if len(request.loras) > self._limits.count:
            raise UnsupportedRequest(
                f"loras: {len(request.loras)} adapters, this node keeps {self._limits.count}"
            )

    @contextlib.contextmanager
    def applied(self, request: GenerationRequest) -> Iterator[None]:
        """Run the body with the request's adapters active (fusing a hot set afterwards)."""
        self._pipeline = request.pipeline
        with torch.no_grad():  # adapter weights are parameters; no forward here needs grads
            self._activate(request.loras)
        yield
        with torch.no_grad():
            self._count_batch(request.loras)

    def state(self) -> AdapterState:
        """What is loaded and fused now, for the heartbeat."""
        return AdapterState(
            pipeline=self._pipeline,
            loaded=tuple(self._loaded),
            fused=tuple(ref.name for ref in self._fused),
            loaded_bytes=sum(self._loaded.values()),
        )

    def _activate(self, refs: tuple[AdapterRef, ...]) -> None:
        if refs and refs == self._fused:
            return  # the weights already are this set
        if self._fused_weights is not None:
            self._fused_weights.unfuse()
            logger.info("adapters %s unfused", [ref.name for ref in self._fused])
            self._fused, self._fused_weights = (), None
        if not refs:
            if self._loaded:
                self._pipe.disable_lora()
            return
        names = [ref.name for ref in refs]
        for name in names:
            self._ensure_loaded(name, keep=frozenset(names))
        self._pipe.enable_lora()
        self._pipe.set_adapters(names, [ref.scale for ref in refs])

    def _ensure_loaded(self, name: str, keep: frozenset[str]) -> None:
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return
        weights = find_adapter(self._roots, self._pipeline, name)
        if weights is None:  # check() found it; only a file removed since gets here
            raise JobFailed(f"loras: adapter {name!r} is gone from this node")
        size = weights.stat().st_size
        self._make_room(size, keep)
        try:
            with _expected_notices_quiet():
                self._pipe.load_lora_weights(
                    str(weights.parent), weight_name=ADAPTER_WEIGHTS, adapter_name=name
                )
        except Exception as exc:
            with contextlib.suppress(Exception):  # a half-loaded adapter must not linger
                self._pipe.delete_adapters(name)
            raise JobFailed(f"loras: adapter {name!r} could not be loaded: {exc}") from exc
        self._loaded[name] = size
        logger.info("adapter %s loaded (%d bytes)", name, size)

    def _make_room(self, size: int, keep: frozenset[str]) -> None:
        """Unload least recently used adapters (not those of this batch) until `size` fits."""
        while self._over_limits(size):
            victim = next((name for name in self._loaded if name not in keep), None)
            if victim is None:
                raise JobFailed(
                    f"loras: the adapters of this request do not fit the adapter cache "
                    f"({self._limits.count} adapters, {self._limits.max_bytes} bytes)"
                )
            self._pipe.delete_adapters(victim)
            del self._loaded[victim]
            logger.info("adapter %s unloaded (least recently used)", victim)

    def _over_limits(self, size: int) -> bool:
        too_many = len(self._loaded) + 1 > self._limits.count
        return too_many or sum(self._loaded.values()) + size > self._limits.max_bytes

    def _count_batch(self, refs: tuple[AdapterRef, ...]) -> None:
        self._streak = self._streak + 1 if refs == self._last else 1
        self._last = refs
        fuse_after = self._limits.fuse_after
        if fuse_after is None or not refs or self._fused or self._streak < fuse_after:
            return
        names = [ref.name for ref in refs]
        self._fused_weights = FusedWeights(self._pipe, self._components(), names)
        self._fused = refs
        logger.info("adapters %s fused after %d batches in a row", names, self._streak)

    def _components(self) -> list[str]:
        # The pipeline's LoRA-capable modules that exist (a pipeline may lack a text encoder).
        loadable: Sequence[str] = getattr(self._pipe, "_lora_loadable_modules", ())
        return [name for name in loadable if getattr(self._pipe, name, None) is not None]


class _DropRecords(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self._fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self._fragment not in record.getMessage()


@contextlib.contextmanager
def _expected_notices_quiet() -> Iterator[None]:
    """Silence the two notices every load gives, and nothing else diffusers or peft says."""
    # peft warns whenever a model gets a second adapter (here that is the point); diffusers logs
    # that an adapter made for the UNet alone has no text-encoder keys.
    text_encoder = logging.getLogger("diffusers.loaders.lora_base")
    drop = _DropRecords("No LoRA keys associated to")
    text_encoder.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
            yield
    finally:
        text_encoder.removeFilter(drop)


def adapter_state(pipeline: object) -> AdapterState | None:
    """The adapter cache state of a loaded pipeline; None for pipelines without one."""
    cache = getattr(pipeline, "adapters", None)
    return cache.state() if isinstance(cache, AdapterCache) else None


def no_adapters(pipe: Any) -> AdapterCache:
    """A cache for a pipeline loaded without an adapters folder: refuses every adapter."""
    return AdapterCache(pipe, None, AdapterLimits())


def adapters_from_settings(pipe: Any, settings: GpuWorkerSettings) -> AdapterCache:
    """The cache the `KILN_LORA_*` settings describe, for `pipe`."""
    limits = AdapterLimits.from_settings(settings)
    return AdapterCache(pipe, settings.lora_dir, limits, fetched=store_adapter_cache(settings))
