"""What previews cost per denoising step on rank 0: the same pipeline with and without them.

    HF_HUB_OFFLINE=1 .venv/bin/python tests/benchmarks/bench_previews.py [--rounds 6] [--steps 20]

In one process, on the CPU: the tiny pipeline (`tiny`, 64x64 and 256x256) runs `--steps` steps,
alternately without previews and with a preview after every step (the default cadence,
`every_steps` 1), decoded by the fitted linear map and by a small random `AutoencoderTiny`
(TAESD-shaped channels, as `KILN_PREVIEW_VAE` would load). A preview's cost is what rank 0 pays
inside the denoising loop: decode, shrink, to uint8 on the host, and the send of the raw pixels
through a pipe to another process, just before the step's `StepDone` (both, as rank 0 sends them
to the coordinator; encoding is the node's, off the loop). Prints per variant the median step
time and its overhead against no previews, and rank 0's own time in a step's callback (preview
and `StepDone`): what previews add to it, as a share of a step without previews, is the direct
measure, which the step medians of a shared machine blur.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
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
    StepDone,
)


class Steps:
    """Rank 0's step callback as the bench runs it: reports each step, times each step.

    Like rank 0 (`LeaderLink.decide_stops`), it sends a `StepDone` to the coordinator's end after
    every step, with or without previews: a preview is sent just before it, so what a preview
    adds to the loop is its decode and a second small message, not the coordinator's wake-up.
    """

    def __init__(self, sender: Connection, tap: PreviewTap | None = None) -> None:
        self.sender = sender
        self.tap = tap
        self.marks: list[float] = [time.perf_counter()]
        self.in_callback: list[float] = []  # seconds in rank 0's own part of each step
        self._previewed_s = 0.0

    def __call__(self, step: int, total: int) -> None:
        started = time.perf_counter()
        self.sender.send(StepDone(1, step, total))
        self.in_callback.append(self._previewed_s + time.perf_counter() - started)
        self._previewed_s = 0.0
        self.marks.append(time.perf_counter())

    def step_times(self) -> list[float]:
        """Seconds per step (the first, which includes the text encoder, left out)."""
        return [b - a for a, b in zip(self.marks[1:], self.marks[2:], strict=False)]


class PreviewingSteps(Steps):
    """`Steps` that is also a `LatentsObserver`: rank 0's previewing step callback."""

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Preview (decode, shrink, send), timing what it adds to the step."""
        assert self.tap is not None
        started = time.perf_counter()
        self.tap.observe(step, total, latents)
        self._previewed_s = time.perf_counter() - started


def small_taesd(folder: Path) -> Path:
    """A random AutoencoderTiny with TAESD's channel widths, saved (as a worker would load it)."""
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    AutoencoderTiny(latent_channels=4).save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


def run_once(
    pipeline: DiffusersPipeline,
    side: int,
    steps: int,
    decoder: LatentDecoder | None,
    sender: Connection,
) -> tuple[list[float], list[float]]:
    """One forward: its step times, and rank 0's own time in each step's callback."""
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
        callback = Steps(sender)
    else:
        tap = PreviewTap(RunBatch(1, (request,)), decoder, sender.send)
        callback = PreviewingSteps(sender, tap)
    pipeline.run([request], callback)
    return callback.step_times(), callback.in_callback[1:]


def _drain(receiver: Connection) -> None:
    """The coordinator's end: take each message off the pipe (in its own process)."""
    try:
        while True:
            receiver.recv()
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
    # the coordinator's end of the pipe: a forked process that only reads (no torch in it)
    receiver, sender = get_context("fork").Pipe(duplex=False)
    drainer = get_context("fork").Process(target=_drain, args=(receiver,), daemon=True)
    drainer.start()
    receiver.close()
    for side in (int(s) for s in args.sides.split(",")):
        times: dict[str, list[float]] = {name: [] for name in variants}
        inside: dict[str, list[float]] = {name: [] for name in variants}
        for round_index in range(args.rounds):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                steps, previews = run_once(pipeline, side, args.steps, variants[name], sender)
                times[name] += steps
                inside[name] += previews
        base = statistics.median(times["none"])
        base_callback = statistics.median(inside["none"])
        print(f"{side}x{side}, {args.steps} steps x {args.rounds} rounds, preview every step:")
        for name, values in times.items():
            median = statistics.median(values)
            overhead = 100 * (median - base) / base
            line = f"  {name:>6}: median step {1000 * median:7.2f} ms ({overhead:+6.1f} %)"
            callback = statistics.median(inside[name])
            line += f"; rank 0's callback {1000 * callback:.3f} ms"
            if name != "none":
                added = 100 * (callback - base_callback) / base
                line += f", previews add {added:.1f} % of a step without previews"
            print(line)
    sender.close()  # the drainer reads EOF and ends
    drainer.join(timeout=5)


if __name__ == "__main__":
    main()
