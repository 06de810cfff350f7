"""docs/pipelines.md: its example passes `kiln pipeline check`, run as a reader runs it.

From a folder holding only the example (and a `tasks.py` of the reader's own), with the console
script and no PYTHONPATH: the module is found in the working directory. The page's protocol table
names every member the protocol has.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kiln.gpu_worker.pipeline_specs import PIPELINE_MEMBERS
from tests.docs.pipeline_example import PIPELINES_DOC, SPEC, write_example

KILN = str(Path(sys.executable).parent / "kiln")


def test_the_example_passes_pipeline_check_from_its_own_folder(tmp_path: Path) -> None:
    write_example(tmp_path)
    (tmp_path / "tasks.py").write_text("RAISE = 1 / 0  # Kiln must never import this\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [KILN, "pipeline", "check", SPEC, "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["output_shapes"] == [[1, 64, 64, 3]]
    assert report["limits"]["max_width"] == 512
    assert set(report["inputs"]["properties"]) == {"brightness"}


def test_the_page_names_every_protocol_member() -> None:
    text = PIPELINES_DOC.read_text()
    optional = ("limits", "input_schema", "preview_decoder", "save_state", "restore_state")
    for member in (*PIPELINE_MEMBERS, *optional, "StopDenoising", "on_step_end"):
        assert f"`{member}" in text, member
