"""The protocol's preview hook: a pipeline names its decoder and hands over its latents.

Rank 0's previews of a `python:` pipeline (`tests.e2e.painted_pipelines`) come from the decoder it
names and the latents it reports with `report_latents`; one without a hook or a VAE has no
decoder, and the schema its node announces says so (`x-kiln-previews`), with its fields.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kiln.common.previews import PREVIEWS_KEY
from kiln.common.request import FIELDS_KEY
from kiln.gpu_worker.pipelines.announced import announced_schema
from kiln.gpu_worker.previews import PreviewTap, build_decoders, can_preview
from kiln.gpu_worker.protocol import PreviewSpec, RunBatch, StepPreview
from tests.e2e.painted_pipelines import PaintedPipeline
from tests.e2e.pipelines import SleepyPipeline
from tests.gpu_worker.conftest import request

CPU = torch.device("cpu")


class TapCallback:
    """Rank 0's previewing step callback, reduced to what the hook reaches: the tap."""

    def __init__(self, tap: PreviewTap) -> None:
        self.tap = tap
        self.steps: list[int] = []

    def __call__(self, step: int, total: int) -> None:
        del total
        self.steps.append(step)

    def observe_latents(self, step: int, total: int, latents: torch.Tensor) -> None:
        """Send the previews due after `step`."""
        self.tap.observe(step, total, latents)


def test_a_pipeline_with_the_hook_previews_what_it_reports_and_one_without_has_none() -> None:
    painted, sleepy = PaintedPipeline(CPU), SleepyPipeline(CPU)
    painted.step_seconds = 0.0
    decoders = build_decoders({"painted": painted, "sleepy": sleepy}, None, CPU)
    assert set(decoders) == {"painted"}
    assert (can_preview(painted), can_preview(sleepy)) == (True, False)

    preview = PreviewSpec(every_steps=2, max_side=32)
    wants = replace(request("a", "painted", steps=4, seed=3, preview=preview), height=32)
    plain = replace(request("b", "painted", steps=4, seed=4), height=32)
    sent: list[StepPreview] = []
    tap = PreviewTap(RunBatch(7, (plain, wants)), decoders["painted"], sent.append)
    callback = TapCallback(tap)
    outputs = painted.run([plain, wants], callback)

    assert callback.steps == [1, 2, 3, 4]
    assert [(p.request_id, p.step, p.total) for p in sent] == [("a", 2, 4), ("a", 4, 4)]
    last = sent[-1].pixels
    assert last.shape == (16, 32, 3)  # the longer side shrunk to the request's max_side
    # the last step's preview is the output itself, shrunk (area) to the preview's size
    output = outputs[1][0][0].astype(np.float64)
    shrunk = output.reshape(16, 2, 32, 2, 3).mean(axis=(1, 3))
    assert np.abs(last.astype(np.float64) - shrunk).max() <= 1.0
    # half-way, half revealed: another picture than the end's
    assert np.abs(sent[0].pixels.astype(np.float64) - last).mean() > 5


def test_the_announced_schema_names_the_fields_and_whether_previews_come() -> None:
    painted = announced_schema(PaintedPipeline(CPU))
    sleepy = announced_schema(SleepyPipeline(CPU))
    assert painted[PREVIEWS_KEY] is True
    assert sleepy[PREVIEWS_KEY] is False
    assert sleepy[FIELDS_KEY] == sorted(SleepyPipeline(CPU).supported_fields())
    assert sleepy["properties"] == {}  # no input_schema(): no inputs of its own
