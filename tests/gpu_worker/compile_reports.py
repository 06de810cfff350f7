"""The start report a compiling rank 0 leaves in its cache folder, read back (tests, benchmarks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.gpu_worker.pipelines.compile import START_REPORT_FILE


def start_report(folder: Path) -> dict[str, Any] | None:
    """The report of the last start that compiled with this cache folder, if any."""
    path = folder / START_REPORT_FILE
    if not path.is_file():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded
