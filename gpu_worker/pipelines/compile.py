"""`torch.compile` of a pipeline's denoiser, with compile caches kept across restarts.

Two caches, both under one folder (`GpuWorkerSettings.compile_cache()`, on a volume in production):

- inductor's own on-disk caches (FX graphs, AOT autograd, generated kernels), pointed there with
  `TORCHINDUCTOR_CACHE_DIR`: a restarted node finds its graphs and skips most of the compile;
- torch.compiler's portable artifacts (`save_cache_artifacts`, the "mega-cache"), one file,
  written by rank 0 after warm-up and loaded by every rank before compiling: copied into a fresh
  container's empty folder, it fills inductor's caches there.

After warm-up rank 0 also writes `last-start.json`: how many FX graphs this start compiled
(misses) and how many it found in the cache (hits), for operators and tests.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from kiln.gpu_worker.pipelines.base import Pipeline
from kiln.gpu_worker.settings import ARTIFACTS_FILE

logger = logging.getLogger(__name__)

START_REPORT_FILE = "last-start.json"
INDUCTOR_FOLDER = "inductor"


def use_compile_cache(folder: Path) -> None:
    """Point this process's inductor caches at `folder`, and load its artifacts file if any.

    Called on every rank before its first compile; the environment is read by inductor when it
    looks for its cache folder, so setting it here is enough.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    (folder / INDUCTOR_FOLDER).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / INDUCTOR_FOLDER)
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    artifacts = folder / ARTIFACTS_FILE
    if artifacts.is_file():
        try:
            torch.compiler.load_cache_artifacts(artifacts.read_bytes())
        except Exception as exc:  # a stale or foreign file costs a compile, never the start
            logger.warning("compile cache: cannot load %s (%s); compiling afresh", artifacts, exc)


def compile_denoiser(pipeline: Pipeline, mode: str) -> bool:
    """Wrap the denoiser's `forward` in torch.compile; False when the pipeline has none.

    Call it before `apply_parallel`: the compiled part is then one rank's own forward, and the
    split of the batch and the gathers between ranks stay outside the graph.
    """
    denoiser = pipeline.denoiser()
    if denoiser is None:
        logger.warning("pipeline %s has no denoiser; nothing to compile", pipeline.name)
        return False
    # An instance attribute shadows the class method, as apply_parallel does: `.config`,
    # `.dtype` and the module's hooks keep working.
    compiled: Any = torch.compile(denoiser.forward, mode=mode)
    denoiser.forward = compiled
    return True


def cache_counters() -> dict[str, int]:
    """This process's FX graph cache hits and misses so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {
        "fx_graph_hits": int(inductor["fxgraph_cache_hit"]),
        "fx_graph_misses": int(inductor["fxgraph_cache_miss"]),
    }


def save_compile_cache(folder: Path, warmup_s: float) -> dict[str, int | float]:
    """Rank 0 after warm-up: write the artifacts file (when this start compiled) and the report."""
    report: dict[str, int | float] = {**cache_counters(), "warmup_s": round(warmup_s, 3)}
    if report["fx_graph_misses"] or not (folder / ARTIFACTS_FILE).is_file():
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            _write_atomically(folder / ARTIFACTS_FILE, saved[0])
    _write_atomically(folder / START_REPORT_FILE, json.dumps(report).encode())
    logger.info("compile cache %s: %s", folder, report)
    return report


def _write_atomically(path: Path, data: bytes) -> None:
    # Several nodes may share the volume: a reader sees the old file or the new, never half.
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    temporary.replace(path)
