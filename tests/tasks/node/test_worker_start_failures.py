"""`kiln worker` whose pipeline cannot start ends in one line naming it and the cause.

A `diffusers:` hub id that HF_HUB_OFFLINE keeps from downloading is refused before anything
heavy loads (exit 2, as a missing folder is). A pipeline whose loading or warm-up raises (a
factory that crashes, a first run that raises, a model folder diffusers cannot load) ends the
worker with one `kiln:` line and exit 1, as `kiln pipeline check` says the same fault: no
traceback, no rank started again. Each case runs the real console script from a folder of its
own, as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kiln.gpu_worker.pipelines.diffusers_pipeline import load_error_text
from kiln.storage.settings import StorageSettings
from tests.tasks.node.test_worker_refusals import KILN, assert_one_line_exit_2

TIMEOUT_S = 300.0
PIPELINE = """
import numpy as np

class Crashy:
    name = "crashy"
    def __init__(self, device): self.device = device
    def supported_fields(self): return frozenset({"prompt", "width", "height", "steps"})
    def validate(self, request): pass
    def denoiser(self): return None
    def run(self, requests, on_step_end):
        raise RuntimeError("no kernel image for this device")

def make_crashy(device) -> Crashy:
    return Crashy(device)

def make_failing(device) -> Crashy:
    raise MemoryError("the weights do not fit")
"""


def start_worker(
    tmp_path: Path, storage_settings: StorageSettings, spec: str, **env: str
) -> subprocess.CompletedProcess[str]:
    """`kiln worker --pipeline SPEC` in `tmp_path`, on the test Redis, to its end."""
    (tmp_path / "crashing.py").write_text(PIPELINE)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(
        KILN_REDIS_URL=storage_settings.redis_url,
        KILN_REDIS_NAMESPACE=storage_settings.redis_namespace,
        KILN_STORAGE_URL=storage_settings.storage_url,
        KILN_METRICS_PORT="0",
        **env,
    )
    return subprocess.run(
        [KILN, "worker", "--pipeline", spec, "--concurrency", "1"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def assert_one_kiln_line_exit_1(result: subprocess.CompletedProcess[str]) -> str:
    """The worker's one error line (its start-up log lines aside); exit 1, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Traceback" not in output
    errors = [line for line in result.stderr.splitlines() if line.startswith("kiln:")]
    assert len(errors) == 1, output
    assert result.stderr.strip().splitlines()[-1] == errors[0]  # nothing after it
    return errors[0]


def offline_and_empty(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS` with HF_HUB_OFFLINE=1 and an empty Hugging Face cache, no Redis reachable."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "KILN_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    return subprocess.run(
        [KILN, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


NOT_CACHED = (
    "diffusers:someone/some-model: someone/some-model is not in the Hugging Face cache ({cache}) "
    "and HF_HUB_OFFLINE forbids downloading it: download it first (hf download "
    "someone/some-model) or unset HF_HUB_OFFLINE"
)


def test_a_hub_id_offline_and_not_cached_is_one_line_before_any_rank(tmp_path: Path) -> None:
    result = offline_and_empty(tmp_path, "worker", "--pipeline", "x=diffusers:someone/some-model")
    refusal = NOT_CACHED.format(cache=tmp_path / "hf-cache")
    assert assert_one_line_exit_2(result) == f"kiln: --pipeline x: {refusal}"


def test_kiln_pipeline_check_refuses_it_the_same_way(tmp_path: Path) -> None:
    result = offline_and_empty(tmp_path, "pipeline", "check", "diffusers:someone/some-model")
    assert (
        assert_one_line_exit_2(result) == f"kiln: {NOT_CACHED.format(cache=tmp_path / 'hf-cache')}"
    )


def test_a_factory_that_crashes_in_warm_up_is_one_line_exit_1(
    tmp_path: Path, storage_settings: StorageSettings
) -> None:
    result = start_worker(tmp_path, storage_settings, "x=python:crashing:make_crashy")
    assert assert_one_kiln_line_exit_1(result) == (
        "kiln: --pipeline x: warm-up raised RuntimeError: no kernel image for this device"
    )


def test_a_factory_that_raises_while_loading_is_one_line_exit_1(
    tmp_path: Path, storage_settings: StorageSettings
) -> None:
    result = start_worker(tmp_path, storage_settings, "x=python:crashing:make_failing")
    assert assert_one_kiln_line_exit_1(result) == (
        "kiln: --pipeline x: loading python:crashing:make_failing raised MemoryError: the "
        "weights do not fit"
    )


@pytest.mark.slow  # diffusers and the model libraries load in the rank before it fails (~20 s)
def test_a_diffusers_folder_that_does_not_load_is_one_line_exit_1(
    tmp_path: Path, storage_settings: StorageSettings
) -> None:
    folder = tmp_path / "half-saved"
    folder.mkdir()
    index = {
        "_class_name": "StableDiffusionPipeline",
        "unet": ["diffusers", "UNet2DConditionModel"],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    result = start_worker(tmp_path, storage_settings, f"x=diffusers:{folder}", HF_HUB_OFFLINE="1")
    line = assert_one_kiln_line_exit_1(result)
    assert line.startswith(f"kiln: --pipeline x: loading diffusers:{folder} raised OSError: ")
    assert "config.json" in line


def test_a_hub_error_says_its_root_cause_not_the_stacktrace_above() -> None:
    try:
        try:
            raise ConnectionError("Cannot reach https://huggingface.co: offline")
        except ConnectionError as cause:
            raise OSError(
                "Cannot load model a/b: not cached. "
                "Please check out the root cause in the stacktrace above."
            ) from cause
    except OSError as exc:
        text = load_error_text(exc)
    assert text == (
        "Cannot load model a/b: not cached. "
        "(cause: ConnectionError: Cannot reach https://huggingface.co: offline)"
    )
