"""Pipeline specs checked before any rank starts: each refusal one line naming what is wrong.

A `python:` module is imported from the working directory (a console script does not put it on
`sys.path`); its factory is looked at without being called: it must say what it makes (be a class
or declare its return type). What a factory actually returns is checked again where it is called
(`load_pipeline`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hub_constants

from kiln.gpu_worker.pipeline_specs import (
    LOADER_MODULES,
    NotAPipeline,
    SpecError,
    check_spec_form,
    loader_modules,
    make_working_directory_importable,
    parse_spec,
)
from kiln.gpu_worker.pipelines import check_spec, load_pipeline

GOOD_CLASS = """
from typing import Any, Optional

import numpy as np

from kiln.gpu_worker.pipelines.base import Pipeline

class Good:
    name = "good"
    def __init__(self, device=None): self.device = device
    def supported_fields(self): return frozenset({"prompt"})
    def validate(self, request): pass
    def run(self, requests, on_step_end):
        return [[np.zeros((1, r.height, r.width, 3), np.uint8)] for r in requests]
    def denoiser(self): return None

class Half:
    name = "half"
    def __init__(self, device=None): self.device = device
    def run(self, requests, on_step_end): return []
"""


@pytest.fixture
def module_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], str]:
    """Writes a module of a fresh name into the working directory; returns the name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])

    def write(code: str) -> str:
        name = f"user_pipeline_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
        return name

    return write


def one_line_error(spec: str) -> str:
    with pytest.raises(SpecError) as caught:
        check_spec(spec)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_spec_forms() -> None:
    assert parse_spec("tiny").kind == "tiny"
    assert parse_spec("diffusers:org/model").target == "org/model"
    parsed = parse_spec("python:pkg.mod:make")
    assert (parsed.module, parsed.factory) == ("pkg.mod", "make")
    for bad in ("nosuch", "python:mod", "python::make", "python:mod:make:x", "diffusers:"):
        with pytest.raises(SpecError, match="expected"):
            parse_spec(bad)


def test_a_diffusers_folder_must_exist_and_hold_a_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SpecError, match="no such folder /nonexistent"):
        check_spec_form("diffusers:/nonexistent")
    with pytest.raises(SpecError, match=r"no model_index\.json"):
        check_spec_form(f"diffusers:{tmp_path}")
    with pytest.raises(SpecError, match="neither a folder here nor a hub id"):
        check_spec_form("diffusers:a/b/c")
    (tmp_path / "model_index.json").write_text("{}")
    assert check_spec_form(f"diffusers:{tmp_path}").target == str(tmp_path)
    # online, a hub id is left to the hub (offline, it must be cached: test_worker_start_failures)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    assert check_spec_form("diffusers:org/model").kind == "diffusers"


def test_a_module_in_the_working_directory_is_found(module_in_cwd: Callable[[str], str]) -> None:
    name = module_in_cwd(GOOD_CLASS + "\ndef make(device) -> Good: return Good()\n")
    assert check_spec(f"python:{name}:make").module == name
    assert load_pipeline(f"python:{name}:make", torch.device("cpu")).name == "good"


def test_an_unimportable_module_is_one_line(module_in_cwd: Callable[[str], str]) -> None:
    assert "no module named 'nowhere_at_all'" in one_line_error("python:nowhere_at_all:make")
    broken = module_in_cwd("import json\nVALUE = json.loads('{')\n")
    message = one_line_error(f"python:{broken}:make")
    assert "importing" in message
    assert "JSONDecodeError" in message
    missing_dependency = module_in_cwd("import not_installed_anywhere\n")
    assert "not_installed_anywhere" in one_line_error(f"python:{missing_dependency}:make")
    syntax = module_in_cwd("def make(device) return 1\n")
    assert f"{syntax}.py:1" in one_line_error(f"python:{syntax}:make")


def test_a_factory_that_is_not_one_is_one_line(module_in_cwd: Callable[[str], str]) -> None:
    name = module_in_cwd(
        GOOD_CLASS
        + textwrap.dedent(
            """
            make_constant = 42
            def make_two(device, dtype): return Good()
            def make_half(device) -> Half: return Half()
            def make_either(device) -> Good | Half: return Good()
            def make_optional(device) -> Optional[Good]: return None
            def make_silently(device): return Good()
            def make_anything(device) -> Any: return Good()
            def make_unresolved(device) -> "Elsewhere": return Good()
            def make_none(device) -> Pipeline: return None
            """
        )
    )
    assert "has no 'absent'" in one_line_error(f"python:{name}:absent")
    assert "is a int, not a factory" in one_line_error(f"python:{name}:make_constant")
    assert "cannot be called with one argument" in one_line_error(f"python:{name}:make_two")
    half = one_line_error(f"python:{name}:make_half")
    assert "lacks supported_fields, validate, denoiser" in half
    assert "lacks supported_fields" in one_line_error(f"python:{name}:Half")  # a class as factory
    assert check_spec(f"python:{name}:Good").factory == "Good"
    assert "makes Half, which is not a Pipeline" in one_line_error(f"python:{name}:make_either")
    assert "makes NoneType" in one_line_error(f"python:{name}:make_optional")
    # What it makes could be learnt only by calling it, after every rank had started.
    assert "make_silently does not say what it makes" in one_line_error(
        f"python:{name}:make_silently"
    )
    assert "returns Any, which names no pipeline class" in one_line_error(
        f"python:{name}:make_anything"
    )
    assert "'Elsewhere' does not resolve (NameError" in one_line_error(
        f"python:{name}:make_unresolved"
    )
    # The protocol itself promises a pipeline: a broken promise is seen when it is called.
    assert check_spec(f"python:{name}:make_none").factory == "make_none"
    with pytest.raises(NotAPipeline, match="returned NoneType, not a Pipeline") as caught:
        load_pipeline(f"python:{name}:make_none", torch.device("cpu"))
    assert "\n" not in str(caught.value)


def test_the_working_directory_goes_last_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["/somewhere"])
    make_working_directory_importable()
    make_working_directory_importable()
    assert sys.path == ["/somewhere", str(tmp_path)]


# A rank that loads the given spec, in a fresh interpreter: which modules it had imported.
RANK_LOAD = """
import json, sys
import torch
import kiln.gpu_worker.ranks.entry
from kiln.gpu_worker.pipelines import load_pipeline
load_pipeline(sys.argv[1], torch.device("cpu"))
print(json.dumps(sorted(sys.modules)))
"""


def rank_imports(spec: str) -> set[str]:
    """The modules a fresh process has after a rank's own imports and `spec`'s load."""
    done = subprocess.run(
        [sys.executable, "-c", RANK_LOAD, spec],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_the_rank_server_preloads_what_loading_a_spec_imports_and_no_more() -> None:
    # The server imports `loader_modules` before it forks (gpu_worker/rank_server.py): a list
    # that misses what loading imports makes each rank pay it; diffusers in the rank entry makes
    # every node pay it.
    assert loader_modules(["python:tests.gpu_worker.fixtures.noop:make"]) == frozenset()
    assert loader_modules(["tiny", "diffusers:/models/x", "not a spec"]) == frozenset(
        LOADER_MODULES["tiny"]
    )
    plain = rank_imports("python:tests.gpu_worker.fixtures.noop:make")
    assert not plain & {"diffusers", "transformers", "peft", *LOADER_MODULES["tiny"]}
    tiny = rank_imports("tiny")
    assert set(LOADER_MODULES["tiny"]) <= tiny
