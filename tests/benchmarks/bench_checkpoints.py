"""Step checkpoints' cost against step time, and their size, for the tiny pipelines on this machine.

Run: `.venv/bin/python tests/benchmarks/bench_checkpoints.py [--steps 20] [--rounds 3]
[--device cpu|cuda]`. For each tiny pipeline and scheduler it runs the same job, in turn each
round, without checkpoints and with one after every step (captured, encoded, and written to a
local object store as storage/checkpoints.py writes it, create-only, in its attempt's folder),
and prints per checkpoint: its size, a plain step's time, the encode and the write time, the
encode's share of a step (what the loop pays if the write is left to another thread), and the
whole checkpoint's share when written inline (the ratio of the two runs' per-step times, minus
1). The share at a cadence of N steps is that divided by N. Ratios from interleaved runs are
what mean anything on a shared machine; absolute times do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline  # noqa: E402
from kiln.gpu_worker.pipelines.diffusers_resume import Checkpointing  # noqa: E402
from kiln.gpu_worker.pipelines.step_checkpoint import DenoiseState, encode  # noqa: E402
from kiln.gpu_worker.pipelines.tiny import ensure_tiny  # noqa: E402
from kiln.gpu_worker.protocol import GenerationRequest  # noqa: E402
from kiln.storage.checkpoints import CONTENT_TYPE, checkpoint_key  # noqa: E402
from kiln.storage.objects import LocalObjectStore, new_attempt_name  # noqa: E402

CASES = [  # (pipeline, scheduler, size, frames)
    ("tiny", None, 64, 1),
    ("tiny", "DPMSolverMultistepScheduler", 64, 1),
    ("tiny-video", None, 32, 5),
]


class Writer:
    """The sink of a run: encodes each state and writes it, timing both."""

    def __init__(self, store: LocalObjectStore) -> None:
        self.store = store
        self.attempt = new_attempt_name(1)
        self.encode_s: list[float] = []
        self.write_s: list[float] = []
        self.sizes: list[int] = []

    def __call__(self, state: DenoiseState) -> None:
        started = time.perf_counter()
        data = encode(state)
        encoded = time.perf_counter()
        key = checkpoint_key(self.store.prefix, "bench", self.attempt, state.steps_done)
        self.store.put(key, data, CONTENT_TYPE, create_only=True)
        self.encode_s.append(encoded - started)
        self.write_s.append(time.perf_counter() - encoded)
        self.sizes.append(len(data))
        self.attempt = new_attempt_name(1)  # the next run's keys are fresh


def timed_run(
    pipeline: DiffusersPipeline, request: GenerationRequest, writer: Writer | None
) -> float:
    checkpointing = None
    if writer is not None:
        checkpointing = Checkpointing(due=lambda _done, _total: True, sink=writer)
    started = time.perf_counter()
    pipeline.run([request], lambda _step, _total: None, checkpointing=checkpointing)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as folder:
        cache, store = Path(folder) / "models", LocalObjectStore(Path(folder) / "objects")
        print(f"{args.steps} steps, a checkpoint after every step, {args.rounds} rounds")
        print(
            "pipeline    scheduler                     bytes  step_ms  encode_ms  write_ms"
            "  encode/step  all/step"
        )
        for kind, scheduler, size, frames in CASES:
            pipeline = DiffusersPipeline.load(str(ensure_tiny(kind, cache)), device, name=kind)
            request = GenerationRequest(
                request_id="bench",
                pipeline=kind,
                prompt="a red kiln",
                width=size,
                height=size,
                steps=args.steps,
                seed=1,
                guidance_scale=5.0,
                num_frames=frames,
                extra_inputs={"scheduler": scheduler} if scheduler else {},
            )
            timed_run(pipeline, request, None)  # warm up
            writer, ratios, plains = Writer(store), [], []
            for _ in range(args.rounds):
                plain = timed_run(pipeline, request, None)
                checkpointed = timed_run(pipeline, request, writer)
                ratios.append(checkpointed / plain)
                plains.append(plain / args.steps)
            step_s, encode_s = statistics.median(plains), statistics.median(writer.encode_s)
            print(
                f"{kind:<11} {scheduler or '(own)':<28} {statistics.median(writer.sizes):>6.0f}"
                f"  {1000 * step_s:>7.1f}  {1000 * encode_s:>9.2f}"
                f"  {1000 * statistics.median(writer.write_s):>8.2f}"
                f"  {100 * encode_s / step_s:>9.1f} %"
                f"  {100 * (statistics.median(ratios) - 1):>6.1f} %"
            )


if __name__ == "__main__":
    main()
