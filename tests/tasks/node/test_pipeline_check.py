"""`kiln pipeline check`: a pipeline run in-process as a node would; each fault one line.

Pipelines here are small classes written into the working directory, each wrong in one way a
model author could get wrong: dtype, shape, count, progress, a swallowed stop.
"""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from kiln.gpu_worker.pipelines import SpecError
from kiln.tasks.cli.main import main
from kiln.tasks.node.pipeline_check import CheckFailed, check_pipeline

TEMPLATE = """
import numpy as np
from kiln.gpu_worker.pipelines import StopDenoising

class Fixture:
    name = "fixture"
    def __init__(self, device): self.device = device
    def supported_fields(self): return frozenset({{"prompt", "width", "height", "steps"}})
    def limits(self): return {{"size_multiple": 48, "max_steps": 10}}
    def validate(self, request): pass
    def denoiser(self): return None
    def run(self, requests, on_step_end):
        for step in range(1, requests[0].steps + 1):
{step}
        return [[{frames} for _ in range(r.num_outputs)] for r in requests]

def make(device) -> Fixture: return Fixture(device)
"""
GOOD_STEP = "            on_step_end(step, requests[0].steps)"
GOOD_FRAMES = "np.zeros((r.num_frames, r.height, r.width, 3), np.uint8)"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])


def fixture_spec(step: str = GOOD_STEP, frames: str = GOOD_FRAMES) -> str:
    name = f"check_fixture_{uuid.uuid4().hex[:8]}"
    Path(f"{name}.py").write_text(textwrap.dedent(TEMPLATE.format(step=step, frames=frames)))
    return f"python:{name}:make"


def failure(spec: str) -> str:
    with pytest.raises(CheckFailed) as caught:
        check_pipeline(spec)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_a_good_pipeline_runs_at_its_smallest_size() -> None:
    report = check_pipeline(fixture_spec())
    # 64 rounded up to a multiple of both the contract's 8 and the pipeline's 48
    assert (report.request.width, report.request.height, report.request.steps) == (96, 96, 1)
    assert report.output_shapes == [(1, 96, 96, 3)]
    assert report.limits == {"size_multiple": 48, "max_steps": 10}
    assert report.steps_reported == 1


def test_wrong_outputs_are_named() -> None:
    assert "dtype float32; expected uint8" in failure(
        fixture_spec(frames="np.zeros((1, r.height, r.width, 3), np.float32)")
    )
    assert "shape (96, 96, 3); expected (frames, height, width, 3) = (1, 96, 96, 3)" in failure(
        fixture_spec(frames="np.zeros((r.height, r.width, 3), np.uint8)")
    )
    assert "is a list of 1; expected a numpy array" in failure(fixture_spec(frames="[0]"))


def test_no_progress_and_a_swallowed_stop_are_named() -> None:
    assert "never called on_step_end" in failure(fixture_spec(step="            pass"))
    swallowing = textwrap.indent(
        "try:\n    on_step_end(step, requests[0].steps)\nexcept StopDenoising:\n    pass",
        " " * 12,
    )
    assert "went on after on_step_end raised StopDenoising" in failure(fixture_spec(swallowing))


def test_the_command_says_one_line_and_exits_by_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pipeline", "check", fixture_spec()]) == 0
    assert capsys.readouterr().out.startswith("ok: python:check_fixture_")
    bad = fixture_spec(frames="np.zeros((1, 8, 8, 3), np.uint8)")
    assert main(["pipeline", "check", bad]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["pipeline", "check", "python:no_such_module_here:make"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "no module named 'no_such_module_here'" in err


def test_a_spec_that_does_not_load_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="unknown pipeline spec"):
        check_pipeline("nosuch")


RESUMABLE = "python:tests.e2e.resumable_pipeline"


def test_a_pipeline_with_the_hooks_is_checked_to_resume_byte_identical() -> None:
    assert check_pipeline(f"{RESUMABLE}:make").resumes is True
    assert check_pipeline(fixture_spec()).resumes is False  # no hooks: restarts from step 0
    forgot = failure(f"{RESUMABLE}:forgetful")
    assert forgot.startswith("a run resumed after step 2 returned other outputs than the run")
    assert "every random generator's get_state()" in forgot
    refused = failure(f"{RESUMABLE}:stubborn")
    assert refused.startswith("restore_state() refused what save_state() gave: restore_state")
    assert "ValueError: cannot go on from step 2 of 4" in refused
