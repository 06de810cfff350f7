"""The README's walk-through runs as written: each command line, in order, against real services.

The block between the `readme-walkthrough` markers is run by bash, unchanged, with `.venv/bin` on
PATH and the environment of a test cluster (its own Redis namespace, a moto S3 bucket, a free API
port). Any line that fails stops the script (`set -e`), and this test fails with its output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.tasks.cli.embedded import free_port
from tests.e2e.cluster import REPO_ROOT, Cluster

WALKTHROUGH = re.compile(
    r"<!-- readme-walkthrough -->\s*```sh\n(?P<script>.*?)```\s*<!-- /readme-walkthrough -->",
    re.DOTALL,
)
RUN_TIMEOUT_S = 240


def readme_walkthrough() -> str:
    """The walk-through block of README.md, exactly as a reader sees it."""
    match = WALKTHROUGH.search((REPO_ROOT / "README.md").read_text())
    assert match, "README.md lost its walk-through block (readme-walkthrough markers)"
    return match.group("script")


def _run(script: str, env: dict[str, str], cwd: Path) -> tuple[int, str]:
    # Its own session, so the background workers and the API it starts are all stopped after;
    # output to a file, since those background processes would hold a pipe open.
    log_path = cwd / "walkthrough.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            _stop_group(process.pid)
    output = log_path.read_text(errors="replace")
    if code == -1:
        pytest.fail(f"the README walk-through ran past {RUN_TIMEOUT_S} s:\n{output[-4000:]}")
    return code, output


def _stop_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    cluster = cluster_factory()
    env = {
        **cluster.env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "KILN_API_PORT": str(free_port()),
        "KILN_CPU_THREADS_PER_RANK": "1",
    }
    script = readme_walkthrough()
    code, output = _run(script, env, tmp_path)
    assert code == 0, f"README walk-through failed (exit {code}):\n{output[-6000:]}"
    video = _json_after(output, '"pipeline": "tiny-video"')
    assert video["status"] == "succeeded"
    assert [o["content_type"] for o in video["outputs"]] == ["video/mp4"]
    assert "kiln worker" in script
    assert "kiln api" in script


def _json_after(output: str, marker: str) -> dict[str, Any]:
    """The first top-level JSON object printed that contains `marker`."""
    for match in re.finditer(r"^\{\n.*?^\}$", output, re.DOTALL | re.MULTILINE):
        if marker in match.group(0):
            data: dict[str, Any] = json.loads(match.group(0))
            return data
    raise AssertionError(f"no JSON output with {marker} in:\n{output[-4000:]}")
