"""The pipelines a rank serves: spec grammar, tiny pipelines, seeds, batching, stop, validation."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch

from kiln.gpu_worker.errors import UnsupportedRequest
from kiln.gpu_worker.parallel import (
    DenoiserCounters,
    ParallelSpec,
    apply_parallel,
    denoiser_counters,
)
from kiln.gpu_worker.pipelines import Pipeline, StopDenoising, load_pipeline
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline, output_seed
from kiln.gpu_worker.pipelines.tiny import TINY_BUILDERS, ensure_tiny, tiny_folder
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings

CPU = torch.device("cpu")


def image_request(**overrides: object) -> GenerationRequest:
    base = GenerationRequest(
        request_id="r",
        pipeline="tiny",
        prompt="a red cat",
        width=64,
        height=64,
        steps=4,
        seed=7,
        guidance_scale=5.0,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def no_progress(step: int, total: int) -> None:
    pass


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    # The machine's 2 cores are shared by parallel test runs; OpenMP threads that spin on a busy
    # core make a tiny forward 5-10x slower, one thread keeps it steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> GpuWorkerSettings:
    return GpuWorkerSettings(model_cache=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tiny(settings: GpuWorkerSettings) -> Pipeline:
    pipeline = load_pipeline("tiny", CPU, settings)
    apply_parallel(pipeline, ParallelSpec("none"), None)  # counts denoiser calls
    return pipeline


@pytest.fixture(scope="module")
def tiny_video(settings: GpuWorkerSettings) -> Pipeline:
    return load_pipeline("tiny-video", CPU, settings)


@pytest.fixture
def counters(tiny: Pipeline) -> DenoiserCounters:
    found = denoiser_counters(tiny)
    assert found is not None
    found.reset()
    return found


# --- spec grammar -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["", "nope", "diffusers:", "python:", "python:only_module"])
def test_malformed_spec_is_rejected(spec: str, settings: GpuWorkerSettings) -> None:
    with pytest.raises(ValueError, match="pipeline spec"):
        load_pipeline(spec, CPU, settings)


def test_python_factory_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "kiln_fixture_pipeline.py").write_text(
        textwrap.dedent(
            """
            import numpy as np

            class Constant:
                name = "constant"
                def supported_fields(self): return frozenset({"prompt"})
                def validate(self, request): pass
                def run(self, requests, on_step_end):
                    return [[np.zeros((1, r.height, r.width, 3), np.uint8)] for r in requests]
                def denoiser(self): return None

            def make(device):
                return Constant()

            def not_a_pipeline(device):
                return object()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    pipeline = load_pipeline("python:kiln_fixture_pipeline:make", CPU)
    assert pipeline.name == "constant"
    assert pipeline.run([image_request()], no_progress)[0][0].shape == (1, 64, 64, 3)
    with pytest.raises(TypeError, match="not a Pipeline"):
        load_pipeline("python:kiln_fixture_pipeline:not_a_pipeline", CPU)


# --- tiny text-to-image ---------------------------------------------------------------------------


def test_tiny_image_has_requested_size_count_and_dtype(tiny: Pipeline) -> None:
    [outputs] = tiny.run([image_request(width=96, height=64, num_outputs=3)], no_progress)
    assert len(outputs) == 3
    for frames in outputs:
        assert frames.shape == (1, 64, 96, 3)
        assert frames.dtype == np.uint8
    assert tiny.name == "tiny"
    assert isinstance(tiny.denoiser(), torch.nn.Module)


def test_same_seed_gives_identical_pixels(tiny: Pipeline) -> None:
    first = tiny.run([image_request(seed=11)], no_progress)[0][0]
    second = tiny.run([image_request(seed=11)], no_progress)[0][0]
    other = tiny.run([image_request(seed=12)], no_progress)[0][0]
    assert np.array_equal(first, second)
    assert not np.array_equal(first, other)


def test_output_i_uses_seed_plus_i(tiny: Pipeline) -> None:
    assert output_seed(5, 2) == 7
    [outputs] = tiny.run([image_request(seed=5, num_outputs=3)], no_progress)
    alone = tiny.run([image_request(seed=7)], no_progress)[0][0]
    np.testing.assert_allclose(outputs[2], alone, atol=1)  # tolerance: batch-size rounding


def test_batch_of_four_equals_four_separate_runs(
    tiny: Pipeline, counters: DenoiserCounters
) -> None:
    requests = [
        image_request(request_id="a", prompt="a red cat", seed=1),
        image_request(request_id="b", prompt="a blue dog", seed=2, negative_prompt="dark"),
        image_request(request_id="c", prompt="a sunset at sea", seed=3, num_outputs=2),
        image_request(request_id="d", prompt="a castle", seed=4),
    ]
    batched = tiny.run(requests, no_progress)
    assert counters.calls == 4  # one forward: 4 steps
    assert counters.rows == 4 * 2 * 5  # CFG doubles the 5 outputs
    separate = [tiny.run([request], no_progress)[0] for request in requests]
    assert [len(outputs) for outputs in batched] == [1, 1, 2, 1]
    for together, alone in zip(batched, separate, strict=True):
        for a, b in zip(together, alone, strict=True):
            # Batched and single matmuls may round differently on CPU: at most 1 level of 255.
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 1


def test_progress_is_reported_after_every_step(tiny: Pipeline) -> None:
    seen: list[tuple[int, int]] = []
    tiny.run([image_request(steps=5)], lambda step, total: seen.append((step, total)))
    assert seen == [(step, 5) for step in range(1, 6)]


def test_stop_at_step_k_runs_no_more_than_k_steps(
    tiny: Pipeline, counters: DenoiserCounters
) -> None:
    before = tiny.run([image_request(seed=31)], no_progress)[0][0]
    counters.reset()

    def stop_at_two(step: int, _total: int) -> None:
        if step == 2:
            raise StopDenoising

    with pytest.raises(StopDenoising):
        tiny.run([image_request(steps=8)], stop_at_two)
    assert counters.calls == 2
    # The stopped forward leaves nothing behind: the next request is as if it never ran.
    assert np.array_equal(tiny.run([image_request(seed=31)], no_progress)[0][0], before)


def test_mixed_batch_is_refused(tiny: Pipeline) -> None:
    with pytest.raises(ValueError, match="batch_key"):
        tiny.run([image_request(), image_request(width=128)], no_progress)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_frames": 9}, "num_frames"),
        ({"width": 60}, "width"),
        ({"height": 0}, "height"),
        ({"steps": 0}, "steps"),
        ({"num_outputs": 0}, "num_outputs"),
    ],
)
def test_unsupported_field_is_named(tiny: Pipeline, overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedRequest, match=f"^{field}:"):
        tiny.validate(image_request(**overrides))


def test_supported_fields(tiny: Pipeline, tiny_video: Pipeline) -> None:
    assert "num_frames" not in tiny.supported_fields()
    assert {"negative_prompt", "guidance_scale", "num_frames"} <= tiny_video.supported_fields()


# --- tiny text-to-video ---------------------------------------------------------------------------


def video_request(**overrides: object) -> GenerationRequest:
    return image_request(**{"pipeline": "tiny-video", "num_frames": 9, "steps": 3, **overrides})


def test_tiny_video_frames_and_seed(tiny_video: Pipeline) -> None:
    [[video]] = tiny_video.run([video_request(seed=3)], no_progress)
    assert video.shape == (9, 64, 64, 3)
    assert video.dtype == np.uint8
    [[again]] = tiny_video.run([video_request(seed=3)], no_progress)
    assert np.array_equal(video, again)


def test_tiny_video_validates_frames_and_size(tiny_video: Pipeline) -> None:
    tiny_video.validate(video_request())
    with pytest.raises(UnsupportedRequest, match=r"^num_frames:"):
        tiny_video.validate(video_request(num_frames=8))
    with pytest.raises(UnsupportedRequest, match=r"^width:"):
        tiny_video.validate(video_request(width=72))  # 8x VAE x 2x2 patches: multiples of 16
    with pytest.raises(UnsupportedRequest, match=r"^num_frames:"):
        tiny_video.run([video_request(num_frames=8)], no_progress)  # run checks too: no rounding


# --- cache: save once, load through from_pretrained -------------------------------------------


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*.safetensors"))
    }


def test_tiny_is_saved_once_and_weights_are_deterministic(
    settings: GpuWorkerSettings, tiny: Pipeline, tmp_path: Path
) -> None:
    folder = ensure_tiny("tiny", settings.model_cache)
    assert folder == tiny_folder("tiny", settings.model_cache)
    assert (folder / "model_index.json").is_file()
    mtime = (folder / "model_index.json").stat().st_mtime_ns
    assert ensure_tiny("tiny", settings.model_cache) == folder
    assert (folder / "model_index.json").stat().st_mtime_ns == mtime  # not rebuilt
    rebuilt = ensure_tiny("tiny", tmp_path)
    assert _digest(rebuilt) == _digest(folder) != {}
    reloaded = load_pipeline(f"diffusers:{rebuilt}", CPU)
    assert isinstance(reloaded, DiffusersPipeline)
    assert reloaded.name == f"diffusers:{rebuilt}"
    request = image_request(seed=21)
    assert np.array_equal(
        reloaded.run([request], no_progress)[0][0], tiny.run([request], no_progress)[0][0]
    )


def test_preparing_a_built_tiny_pipeline_imports_no_diffusers(settings: GpuWorkerSettings) -> None:
    # A node prepares its pipelines before its ranks start; diffusers there is seconds of CPU.
    ensure_tiny("tiny-video", settings.model_cache)
    cache = str(settings.model_cache)
    code = (
        "import sys\n"
        "from kiln.gpu_worker.pipelines import prepare_pipeline\n"
        "from kiln.gpu_worker.settings import GpuWorkerSettings\n"
        f"prepare_pipeline('tiny-video', GpuWorkerSettings(model_cache={cache!r}))\n"
        "print(sorted(name for name in ('diffusers', 'transformers') if name in sys.modules))\n"
    )
    prepared = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert prepared.stdout.strip() == "[]", prepared.stderr


def test_losing_a_build_race_keeps_the_winners_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = TINY_BUILDERS["tiny"]

    def build_while_another_process_wins(workdir: Path) -> object:
        monkeypatch.setitem(TINY_BUILDERS, "tiny", build)
        ensure_tiny("tiny", tmp_path)  # the "other process" finishes first
        return build(workdir)

    monkeypatch.setitem(TINY_BUILDERS, "tiny", build_while_another_process_wins)
    folder = ensure_tiny("tiny", tmp_path)
    assert (folder / "model_index.json").is_file()
    assert [path.name for path in tmp_path.iterdir()] == [folder.name]  # no temp folder left
