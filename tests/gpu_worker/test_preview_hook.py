"""The protocol's preview hook: a pipeline names its decoder and hands over its latents.

Rank 0's previews of a `python:` pipeline (`tests.e2e.painted_pipelines`) come from the decoder it
names and the latents it reports with `report_latents`; one without a hook or a VAE has no
decoder, and the schema its node announces says so (`x-kiln-previews`), with its fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch

from kiln.common.previews import PREVIEWS_KEY
from kiln.common.request import FIELDS_KEY
from kiln.gpu_worker.pipelines import PreviewDecoder, StepCallback
from kiln.gpu_worker.pipelines.announced import announced_schema
from kiln.gpu_worker.previews import PreviewTap, build_decoders, can_preview, check_preview_hook
from kiln.gpu_worker.protocol import GenerationRequest, PreviewSpec, RunBatch, StepPreview
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


class Silent(PaintedPipeline):
    """Names a decoder but never reports its latents."""

    def run(
        self, requests: Sequence[GenerationRequest], on_step_end: StepCallback
    ) -> list[list[np.ndarray]]:
        return super().run(requests, lambda step, total: on_step_end(step, total))


class Flat(PaintedPipeline):
    """Reports its latents, but its decoder returns one channel."""

    def preview_decoder(self) -> PreviewDecoder:
        return lambda latents: latents[:, :1]


def test_the_hook_check_passes_a_working_hook_and_names_what_is_wrong_with_a_broken_one() -> None:
    checked = request("check", "painted", steps=2)
    painted = PaintedPipeline(CPU)
    painted.step_seconds = 0.0
    assert check_preview_hook(painted, checked) is True
    assert check_preview_hook(SleepyPipeline(CPU), checked) is False
    silent, flat = Silent(CPU), Flat(CPU)
    silent.step_seconds = flat.step_seconds = 0.0
    with pytest.raises(ValueError, match="never called report_latents"):
        check_preview_hook(silent, checked)
    with pytest.raises(ValueError, match=r"returned \(1, 1, 64, 64\); expected \(1, 3, H, W\)"):
        check_preview_hook(flat, checked)


def test_kiln_pipeline_check_runs_the_preview_hook() -> None:
    from kiln.tasks.node.pipeline_check import CheckFailed, check_pipeline

    check_pipeline("python:tests.e2e.painted_pipelines:painted")
    with pytest.raises(CheckFailed, match=r"the preview hook raised .*never called report_latents"):
        check_pipeline("python:tests.gpu_worker.test_preview_hook:Silent")
