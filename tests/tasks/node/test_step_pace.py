"""An attempt's seconds per step are its denoising steps' pace, not its whole forward's.

The forward's time (`RunMetrics.run_s`) also holds what runs before the first step (the text
encoders, a checkpoint's restore): charged to a short run's few steps it overstated the attempt's
`step_s`, and with it `seconds_lost` (recomputed steps x step_s, kiln/common/accounting.py).
The group here is the conftest's fake, whose forward spends ENCODE_S before its first step and
STEP_S in each, by the wall clock.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import numpy as np
import pytest

from kiln.common.states import JobState
from kiln.gpu_worker.protocol import GenerationRequest, GenerationResult, RunMetrics, StepProgress
from kiln.gpu_worker.tickets import ShouldStop
from tests.tasks.node.conftest import STEPS, NodeFactory

ENCODE_S = 1.0
STEP_S = 0.05


def encoding_first(
    request: GenerationRequest,
    on_progress: Callable[[StepProgress], None] | None,
    should_stop: ShouldStop | None,
) -> GenerationResult:
    """A forward as the ranks run it: the prompt encoded, then the steps, each reported."""
    del should_stop
    began = time.monotonic()
    time.sleep(ENCODE_S)
    for step in range(1, request.steps + 1):
        time.sleep(STEP_S)
        if on_progress is not None:
            on_progress(StepProgress("denoising", step, request.steps))
    frames = np.full((request.num_frames, request.height, request.width, 3), 128, np.uint8)
    metrics = RunMetrics(
        run_s=time.monotonic() - began, peak_memory_mb=0.0, steps_run=request.steps, batch_size=1
    )
    return GenerationResult(request.request_id, [frames] * request.num_outputs, metrics)


def test_step_seconds_are_the_denoising_steps_pace_not_the_forwards(
    make_node: NodeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = make_node()
    monkeypatch.setattr(harness.coordinator, "_run", encoding_first)
    job_id = harness.submit()
    harness.deliver(job_id)

    assert harness.store.get(job_id).state == JobState.SUCCEEDED
    (attempt,) = json.loads(
        harness.store.redis.hget(harness.store.keys.job(job_id), "attempt_log") or ""
    )
    # every step slept STEP_S; the forward's mean over STEPS steps would be over ENCODE_S / STEPS
    assert STEP_S <= attempt["step_s"] < ENCODE_S / STEPS
