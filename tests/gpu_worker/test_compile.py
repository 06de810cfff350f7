"""`KILN_COMPILE` and `KILN_WARMUP` on CPU ranks (gpu_worker/pipelines/compile.py, warmup.py).

The denoiser is compiled with inductor (a C++ compiler on CPU) during the warm-up shapes, before
the group is ready; the compile caches land in the cache folder, and a restarted group finds its
graphs there instead of compiling them again, as does a fresh folder holding only the portable
artifacts file. Compiled outputs equal eager ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.pipelines.compile import INDUCTOR_FOLDER
from kiln.gpu_worker.settings import ARTIFACTS_FILE, GpuWorkerSettings
from kiln.gpu_worker.warmup import WarmupShape, parse_warmup_shape
from tests.gpu_worker.compile_reports import start_report
from tests.gpu_worker.conftest import GENEROUS_S, request, start_coordinator
from tests.gpu_worker.fixtures import spec

PIPELINES = {"light": spec("weighty", "make_light")}
WARMUP = "16x16x1"


def compiled_group(cache: Path) -> Coordinator:
    """One CPU rank compiling its denoiser, warmed up on the smallest shape."""
    settings = GpuWorkerSettings(compile=True, compile_cache_dir=cache, warmup=[WARMUP])
    return start_coordinator("cpu:1", PIPELINES, settings=settings)


def outputs(coordinator: Coordinator) -> list[np.ndarray]:
    """The outputs of one job of the warm-up's shape."""
    job = request("compiled", "light", size=16, steps=1, seed=3)
    return coordinator.submit(job).result(GENEROUS_S).outputs


@pytest.mark.slow
def test_a_restart_finds_the_compiled_graphs_in_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "compile"
    first = compiled_group(cache)
    try:
        compiled = outputs(first)
    finally:
        first.shutdown()
    cold = start_report(cache)
    assert cold is not None
    assert cold["fx_graph_misses"] > 0
    assert cold["fx_graph_hits"] == 0
    assert (cache / ARTIFACTS_FILE).is_file()
    assert any((cache / INDUCTOR_FOLDER).iterdir())

    # A fresh container: an empty folder but for the artifacts file (from the object store).
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ARTIFACTS_FILE).write_bytes((cache / ARTIFACTS_FILE).read_bytes())
    compiled_group(fresh).shutdown()
    from_artifacts = start_report(fresh)
    assert from_artifacts is not None
    assert from_artifacts["fx_graph_hits"] > 0
    assert from_artifacts["fx_graph_misses"] == 0

    second = compiled_group(cache)
    try:
        assert start_report(cache) != cold
        warm = start_report(cache)
        assert warm is not None
        assert warm["fx_graph_hits"] > 0
        assert warm["fx_graph_misses"] == 0
        eager = start_coordinator("cpu:1", PIPELINES, settings=GpuWorkerSettings())
        try:
            for left, right in zip(compiled, outputs(eager), strict=True):
                np.testing.assert_array_equal(left, right)
        finally:
            eager.shutdown()
    finally:
        second.shutdown()


@pytest.mark.parametrize(
    ("text", "shape"),
    [("512x512x25", WarmupShape(512, 512, 25)), ("64X48x2x9", WarmupShape(64, 48, 2, 9))],
)
def test_warmup_shapes_parse(text: str, shape: WarmupShape) -> None:
    assert parse_warmup_shape(text) == shape
    assert parse_warmup_shape(str(shape)) == shape


@pytest.mark.parametrize("text", ["512x512", "0x64x2", "axbxc", "64x64x2x1x1", ""])
def test_malformed_warmup_shapes_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="warm-up shape"):
        parse_warmup_shape(text)


def test_warmup_setting_takes_a_comma_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_WARMUP", "512x512x25, 64x64x2x9")
    assert GpuWorkerSettings().warmup == ["512x512x25", "64x64x2x9"]
    monkeypatch.setenv("KILN_WARMUP", "512x512")
    with pytest.raises(ValueError, match=r"warm-up shape"):
        GpuWorkerSettings()
