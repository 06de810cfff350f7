"""`from kiln import KilnClient, JobRequest` (what the README shows) works and loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys

import kiln

PROBE = """
import json, sys
from kiln import BatchResult, BatchSummary, BatchView, JobRequest, JobView, KilnClient, KilnError
heavy = [m for m in sys.modules if m.split(".")[0] in ("torch", "diffusers", "transformers")]
print(json.dumps([KilnClient.__module__, JobRequest(prompt="x").pipeline, heavy]))
"""


def test_the_producer_names_import_from_kiln_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["kiln.tasks.client.client", "default", []]


def test_every_exported_name_resolves() -> None:
    for name in kiln.__all__:
        assert getattr(kiln, name).__name__ == name
