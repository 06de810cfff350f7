"""What previews cost per denoising step on rank 0: the same pipeline with and without them.

    HF_HUB_OFFLINE=1 .venv/bin/python tests/benchmarks/bench_previews.py [--rounds 6] [--steps 20]

In one process, on the CPU: the tiny pipeline (`tiny`, 64x64 and 256x256) runs `--steps` steps,
alternately without previews and with a preview after every step (the default cadence,
`every_steps` 1), decoded by the fitted linear map and by a small random `AutoencoderTiny`
(TAESD-shaped channels, as `KILN_PREVIEW_VAE` would load). A preview's cost is what rank 0 pays
inside the denoising loop: decode, shrink, to uint8 on the host, and the send of the raw pixels
through a pipe (the coordinator's end drains it on another thread; encoding is the node's, off
the loop). Prints the median step time per variant and the overhead against no previews.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kiln.gpu_worker.pipelines import load_pipeline  # noqa: E402
from kiln.gpu_worker.pipelines.diffusers_pipeline import DiffusersPipeline  # noqa: E402
from kiln.gpu_worker.previews import (  # noqa: E402
    LatentDecoder,
    PreviewTap,
    TinyAutoencoderDecoder,
    fit_linear_map,
)
from kiln.gpu_worker.protocol import (  # noqa: E402
    GenerationRequest,
    PreviewSpec,
    RunBatch,
    StepPreview,
)


class Steps:
    """A step callback timing each step; previewing through `tap` when one is given."""

    def __init__(self, tap: PreviewTap | None) -> None:
        self.tap = tap
        self.marks: list[float] = [time.perf_counter()]
        self.in_previews: list[float] = []  # seconds inside each preview (decode, send)

    def __call__(self, step: int, total: int) -> None:
        del step, total
        self.marks.append(time.perf_counter())

    def step_times(self) -> list[float]:
        """Seconds per step (the first, which includes the text encoder, left out)."""
        return [b - a for a, b in zip(self.marks[1:], self.marks[2:], strict=False)]


class PreviewingSteps(Steps):
    """`Steps` that is also a `LatentsObserver`: rank 0's previewing step callback."""

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Preview, timing what it adds to the step."""
        assert self.tap is not None
        started = time.perf_counter()
        self.tap.observe(step, total, latents)
        self.in_previews.append(time.perf_counter() - started)


def small_taesd(folder: Path) -> Path:
    """A random AutoencoderTiny with TAESD's channel widths, saved (as a worker would load it)."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    AutoencoderTiny(latent_channels=4).save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def run_once(
    pipeline: DiffusersPipeline, side: int, steps: int, decoder: LatentDecoder | None
) -> tuple[list[float], list[float]]:
    """One forward: its step times, and the time inside each preview."""
    preview = PreviewSpec(every_steps=1) if decoder is not None else None
    request = GenerationRequest(
        request_id="bench",
        pipeline="tiny",
        prompt="a kiln",
        width=side,
        height=side,
        steps=steps,
        seed=1,
        guidance_scale=5.0,
        preview=preview,
    )
    if decoder is None:
        callback = Steps(None)
    else:
        sender, receiver = Pipe()
        drained = threading.Thread(target=_drain, args=(receiver,), daemon=True)
        drained.start()

        def send(message: StepPreview) -> None:
            sender.send(message)

        callback = PreviewingSteps(PreviewTap(RunBatch(1, (request,)), decoder, send))
    pipeline.run([request], callback)
    return callback.step_times(), callback.in_previews[1:]


def _drain(receiver: object) -> None:
    try:
        while True:
            receiver.recv()  # type: ignore[attr-defined]
    except (EOFError, OSError):
        return


def main() -> None:
    """Alternate the variants for `--rounds`; print medians and overheads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sides", default="64,256")
    parser.add_argument("--variants", default="none,linear,taesd")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipeline = load_pipeline("tiny", torch.device("cpu"))
    assert isinstance(pipeline, DiffusersPipeline)
    started = time.perf_counter()
    linear = fit_linear_map(pipeline.pipe.vae)
    print(f"linear map fitted in {1000 * (time.perf_counter() - started):.0f} ms")
    with tempfile.TemporaryDirectory() as folder:
        tiny = TinyAutoencoderDecoder.load(
            small_taesd(Path(folder)), torch.device("cpu"), torch.float32
        )
    decoders: dict[str, LatentDecoder | None] = {"none": None, "linear": linear, "taesd": tiny}
    variants = {name: decoders[name] for name in args.variants.split(",")}
    for side in (int(s) for s in args.sides.split(",")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        inside: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                steps, previews = run_once(pipeline, side, args.steps, variants[name])
                times[name] += steps
                inside[name] += previews
        base = statistics.median(times["none"])
        print(f"{side}x{side}, {args.steps} steps x {args.rounds} rounds, preview every step:")
        for name, values in times.items():
            median = statistics.median(values)
            overhead = 100 * (median - base) / base
            line = f"  {name:>6}: median step {1000 * median:7.2f} ms ({overhead:+6.1f} %)"
            if inside[name]:
                spent = statistics.median(inside[name])
                line += f"; inside the preview {1000 * spent:.3f} ms = {100 * spent / base:.1f} %"
                line += " of a step without previews"
            print(line)


if __name__ == "__main__":
    main()
