"""The example pipeline of docs/pipelines.md, exactly as a reader copies it."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PIPELINES_DOC = REPO_ROOT / "docs" / "pipelines.md"
EXAMPLE = re.compile(
    r"<!-- pipeline-example -->\s*```python\n(?P<code>.*?)```\s*<!-- /pipeline-example -->",
    re.DOTALL,
)
MODULE = "solidcolor"  # the file name the page tells the reader to save it under
SPEC = f"python:{MODULE}:make"


def pipeline_example() -> str:
    """The code block between the `pipeline-example` markers."""
    match = EXAMPLE.search(PIPELINES_DOC.read_text())
    assert match, "docs/pipelines.md lost its example (pipeline-example markers)"
    return match.group("code")


def write_example(folder: Path) -> Path:
    """Save the example in `folder` as the page says; the path of the module."""
    path = folder / f"{MODULE}.py"
    path.write_text(pipeline_example())
    return path
