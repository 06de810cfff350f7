"""Per-request LoRA with `KILN_COMPILE`: a compiled denoiser computes what the eager one does.

The tiny pipeline's UNet compiled with inductor (as `compile_denoiser` does on a rank) and an
eager copy run the same jobs, switching adapters between jobs: each compiled picture is within
1/255 of the eager one. Switching costs recompiles, which this test pins down: dynamo guards on
the adapter layers a rank holds and on which of them are active, so a job that meets a state not
seen before compiles a new graph, and one that meets a seen state reuses its graph. (Measured
beyond this test, docs/operations.md §13: a scale change costs one more graph the first time,
after which dynamo makes the scale an input; past dynamo's recompile limit, 8, new states run
eager.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from kiln.gpu_worker.pipelines import load_pipeline
from kiln.gpu_worker.pipelines.compile import compile_denoiser, use_compile_cache
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline
from kiln.gpu_worker.protocol import AdapterRef, GenerationRequest
from kiln.gpu_worker.settings import GpuWorkerSettings
from tests.gpu_worker.tiny_lora import build_tiny_lora

CPU = torch.device("cpu")
ONE_LEVEL = 1  # 1/255


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: one thread keeps a tiny forward steady
    yield
    torch.set_num_threads(threads)


def job(*loras: tuple[str, float]) -> GenerationRequest:
    refs = tuple(AdapterRef(name, scale) for name, scale in loras)
    return GenerationRequest("r", "tiny", "a kiln at dusk", 64, 64, 2, 5, guidance_scale=5.0,
                             loras=refs)  # fmt: skip


def pixels(pipeline: DiffusersPipeline, request: GenerationRequest) -> np.ndarray:
    pipeline.validate(request)
    ((frames,),) = pipeline.run([request], lambda _step, _total: None)
    return frames.astype(np.int16)


def graphs() -> int:
    """FX graphs dynamo has compiled in this process so far."""
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
@pytest.mark.timeout(1500)  # inductor on shared CPU cores: minutes for the first graph
# inductor's first import defines TorchScript classes (torch.utils.mkldnn): torch's own notice
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")
def test_a_compiled_denoiser_applies_each_jobs_adapters(tmp_path: Path) -> None:
    models, loras = tmp_path / "models", tmp_path / "loras"
    base = load_pipeline("tiny", CPU, GpuWorkerSettings(model_cache=models))
    assert isinstance(base, DiffusersPipeline)
    for name, seed in {"ember": 1, "frost": 2}.items():
        build_tiny_lora(base.pipe.unet, loras / "tiny" / name, seed)
    settings = GpuWorkerSettings(model_cache=models, lora_dir=loras)
    eager, compiled = (load_pipeline("tiny", CPU, settings) for _ in range(2))
    assert isinstance(eager, DiffusersPipeline)
    assert isinstance(compiled, DiffusersPipeline)
    torch._dynamo.reset()  # no graph of another test counts against the recompile limit
    use_compile_cache(tmp_path / "compile")
    assert compile_denoiser(compiled, "default")

    seen: dict[tuple[tuple[str, float], ...], np.ndarray] = {}
    new_graphs: list[int] = []
    # Loaded {ember}, ember on; loaded {ember, frost}: frost on, ember on; frost on again.
    for loras_of_job in ([("ember", 0.8)], [("frost", 0.8)], [("ember", 0.8)], [("frost", 0.8)]):
        before = graphs()
        got = pixels(compiled, job(*loras_of_job))
        new_graphs.append(graphs() - before)
        assert np.abs(got - pixels(eager, job(*loras_of_job))).max() <= ONE_LEVEL, loras_of_job
        seen[tuple(loras_of_job)] = got
    # Each job got its own adapter (not the graph of the one before it) ...
    assert np.abs(seen[(("ember", 0.8),)] - seen[(("frost", 0.8),)]).max() > 10 * ONE_LEVEL
    # ... at the cost of one graph per adapter state not seen before; a seen one is reused.
    assert new_graphs == [1, 1, 1, 0]
