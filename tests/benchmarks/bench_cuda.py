"""CUDA path benchmark (run on a GPU machine).

Kiln's group with nccl on one GPU driving an SD3-medium-sized DiT with random weights in bf16;
steps/s and peak memory at batch 1/4/8, 512² and 1024². Usage, from the repository root:
`python -m tests.benchmarks.bench_cuda [--steps 10] [--sizes 512,1024]`.

steps/s is measured between the first and last denoising-step progress reports of a batch (so
text encoding and VAE decode are excluded); `run s` is the whole forward as the rank measured it.
"""

from __future__ import annotations

import argparse
import time
import uuid

import torch

from kiln.gpu_worker.config import GroupConfig
from kiln.gpu_worker.coordinator import Coordinator
from kiln.gpu_worker.outputs import OutputSpec, encode
from kiln.gpu_worker.protocol import GenerationRequest, StepProgress

PIPELINE = "python:tests.benchmarks.cuda_dit:sd3_medium"


def run_batch(coordinator: Coordinator, size: int, batch: int, steps: int) -> dict[str, float]:
    """Submit `batch` compatible requests at once; time their shared forward."""
    step_times: list[float] = []

    def on_progress(progress: StepProgress) -> None:
        if progress.stage == "denoising":
            step_times.append(time.perf_counter())

    requests = [
        GenerationRequest(
            request_id=uuid.uuid4().hex,
            pipeline="sd3m",
            prompt=f"a photo {i}",
            width=size,
            height=size,
            steps=steps,
            seed=i,
            guidance_scale=5.0,
        )
        for i in range(batch)
    ]
    started = time.perf_counter()
    futures = [
        coordinator.submit(r, on_progress=on_progress if i == 0 else None)
        for i, r in enumerate(requests)
    ]
    results = [f.result(timeout=600) for f in futures]
    wall = time.perf_counter() - started
    metrics = results[0].metrics
    assert metrics is not None
    frames = results[0].outputs[0]
    assert frames.shape == (1, size, size, 3), frames.shape
    png = encode(frames, OutputSpec(format="png"))
    denoise_s = step_times[-1] - step_times[0] if len(step_times) > 1 else float("nan")
    return {
        "batch_run": metrics.batch_size,
        "steps_per_s": (len(step_times) - 1) / denoise_s,
        "run_s": metrics.run_s,
        "wall_s": wall,
        "peak_mb": metrics.peak_memory_mb,
        "png_kb": len(png.data) / 1024,
    }


def main() -> None:
    """Start the group, warm up per size, measure, print a table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", default="512,1024")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--device", default="cuda:0", help="cpu:1 for a smoke run")
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    print(f"torch {torch.__version__}, {gpu}", flush=True)
    config = GroupConfig(
        devices=[args.device],
        pipelines={"sd3m": PIPELINE},
        max_batch=8,
        batch_window_s=0.2,
        ready_timeout_s=600,
        warmup=False,
        node_name="bench",
    )
    coordinator = Coordinator(config)
    started = time.perf_counter()
    coordinator.start()
    print(f"group ready in {time.perf_counter() - started:.1f}s (spawn, nccl init, build on GPU)")
    print("size  batch  ran-as  steps/s  run s  wall s  peak MiB  png KiB", flush=True)
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            run_batch(coordinator, size, 1, 2)  # warm-up: kernels, allocator, cuDNN
            for batch in (int(b) for b in args.batches.split(",")):
                r = run_batch(coordinator, size, batch, args.steps)
                print(
                    f"{size:>4}  {batch:>5}  {r['batch_run']:>6}  {r['steps_per_s']:>7.2f}  "
                    f"{r['run_s']:>5.2f}  {r['wall_s']:>6.2f}  {r['peak_mb']:>8.0f}  "
                    f"{r['png_kb']:>7.0f}",
                    flush=True,
                )
    finally:
        coordinator.shutdown()


if __name__ == "__main__":
    main()
