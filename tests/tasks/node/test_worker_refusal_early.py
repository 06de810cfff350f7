"""`kiln worker` refuses a pipeline it cannot serve early: before anything heavy, or at load.

A spec refused before any rank starts is checked right after the arguments are parsed: the
refusal must come without torch, Celery, Redis, pydantic or the node's modules loaded (each of
them costs a large part of the 2 s a refusal may take). What the user's module imports is its
own; the modules here import nothing. A factory must say what it makes (one that does not is
refused here too); one that declares the `Pipeline` protocol and returns something else is seen
only when rank 0 calls it: the worker then ends in the same one line, exit 2, with no traceback
and the ranks not started again.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kiln.gpu_worker.pipeline_specs import PIPELINE_MEMBERS, PipelineRefused
from kiln.gpu_worker.pipelines.base import Pipeline
from kiln.storage.settings import StorageSettings
from tests.tasks.node.test_worker_refusals import KILN, assert_one_line_exit_2, kiln

# Loaded by a worker that starts, never by one refusing its pipelines from the command line.
HEAVY = (
    "torch",
    "numpy",
    "celery",
    "kombu",
    "redis",
    "pydantic",
    "pydantic_settings",
    "rich",
    "httpx",
    "kiln.settings_check",
    "kiln.tasks.node.worker",
    "kiln.gpu_worker.pipelines",
)
MODULES = {
    "raising.py": "RATIO = 1 / 0\n",
    "needs_more.py": "import a_dependency_not_installed\n",
    "factories.py": """
class Half:
    name = "half"
    def __init__(self, device): pass
    def run(self, requests, on_step_end): return []

def make_half(device) -> Half:
    return Half(device)

def make_two(device, dtype):
    return Half(device)

def make_unsaid(device):
    return Half(device)
""",
    # A promise only the call can break; importing the protocol loads torch, as a real module's
    # import would.
    "promises.py": """
from kiln.gpu_worker.pipelines.base import Pipeline

def make_silently(device) -> Pipeline:
    with open("calls.log", "a") as calls:  # one line per call: per rank that got this far
        calls.write("called\\n")
    return object()
""",
}
# Records, at exit, which of HEAVY the command loaded (written to a file: the output is checked
# to be one line).
RECORD_LOADED = f"""
import atexit, json
def _record():
    with open("loaded.json", "w") as f:
        json.dump([m for m in {HEAVY!r} if m in sys.modules], f)
atexit.register(_record)
"""


@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [
        ("nosuch", "--pipeline nosuch: unknown pipeline spec 'nosuch'"),
        ("x=diffusers:/nonexistent", "--pipeline x: diffusers:/nonexistent: no such folder"),
        ("x=diffusers:./relative", "no such folder relative"),
        ("x=python:absent_module:make", "no module named 'absent_module'"),
        ("x=python:raising:make", "importing raising raised ZeroDivisionError"),
        ("x=python:needs_more:make", "No module named 'a_dependency_not_installed'"),
        ("x=python:factories:absent", "has no 'absent'"),
        ("x=python:factories:make_two", "cannot be called with one argument"),
        ("x=python:factories:make_half", "makes Half, which is not a Pipeline"),
        ("x=python:factories:Half", "lacks supported_fields, validate, denoiser"),
        ("x=python:factories:make_unsaid", "make_unsaid does not say what it makes"),
    ],
)
def test_a_refusal_before_any_rank_loads_nothing_heavy(
    tmp_path: Path, pipeline: str, expected: str
) -> None:
    for name, code in MODULES.items():
        (tmp_path / name).write_text(code)
    result = kiln("worker", "--pipeline", pipeline, cwd=tmp_path, prelude=RECORD_LOADED)
    assert_one_line_exit_2(result, expected)
    assert json.loads((tmp_path / "loaded.json").read_text()) == []


def test_a_bad_flag_beside_the_pipelines_is_refused_as_early(tmp_path: Path) -> None:
    result = kiln("worker", "--pipeline", "tiny", "--queues", "urgent", cwd=tmp_path)
    assert_one_line_exit_2(result, "--queues: unknown lane(s) ['urgent']")
    result = kiln("worker", "--pipeline", "tiny", "--max-batch", "0", cwd=tmp_path)
    assert_one_line_exit_2(result, "--max-batch must be at least 1")


def test_the_members_checked_without_torch_are_the_protocols() -> None:
    declared = {
        name for name in (*Pipeline.__annotations__, *vars(Pipeline)) if not name.startswith("_")
    }
    assert set(PIPELINE_MEMBERS) == declared


def test_a_ranks_refusal_is_read_back_from_the_start_error() -> None:
    refused = PipelineRefused("x", 'python:m:make: make(device) returned "a\\tb", not a Pipeline')
    text = f"starting the worker group failed: rank 0 failed to start:\n{refused.rank_message()}"
    found = PipelineRefused.found_in(text)
    assert found is not None
    assert (found.name, found.reason) == (refused.name, refused.reason)
    assert "\n" not in refused.rank_message()
    assert PipelineRefused.found_in("rank 0 failed to start:\nTraceback (most recent...") is None
    assert PipelineRefused.found_in(f"{PipelineRefused.MARK}not json") is None


@pytest.mark.slow
def test_a_factory_that_returns_no_pipeline_ends_the_start_in_one_line(
    storage_settings: StorageSettings, tmp_path: Path
) -> None:
    (tmp_path / "promises.py").write_text(MODULES["promises.py"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {
        "KILN_REDIS_URL": storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": storage_settings.redis_namespace,
        "KILN_STORAGE_URL": storage_settings.storage_url,
        "KILN_METRICS_PORT": "0",
    }
    spec = "x=python:promises:make_silently"
    args = [KILN, "worker", "--devices", "cpu:2", "--pipeline", spec]
    result = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        "kiln: --pipeline x: python:promises:make_silently: make_silently(device) returned "
        "object, not a Pipeline: it lacks name, supported_fields, validate, run, denoiser "
        "(docs/pipelines.md)"
    ), output
    assert "Traceback" not in output
    assert output.count("not a Pipeline") == 1, output
    # once per rank at most (rank 1 may be stopped before it calls it): no rank started again
    assert 1 <= len((tmp_path / "calls.log").read_text().splitlines()) <= 2
