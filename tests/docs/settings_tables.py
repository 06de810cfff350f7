"""README's configuration tables, rendered from the settings classes (the one source of truth).

`python -m tests.docs.settings_tables` rewrites the tables in README.md in place;
`tests/docs/test_settings_tables.py` fails when README and the classes disagree.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from kiln.gpu_worker.settings import GpuWorkerSettings
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- settings-tables -->", "<!-- /settings-tables -->"
SECTIONS: tuple[tuple[str, type[BaseSettings]], ...] = (
    ("Storage (`storage/settings.py`)", StorageSettings),
    ("GPU worker (`gpu_worker/settings.py`)", GpuWorkerSettings),
    ("Tasks: Celery, node, API, webhooks (`tasks/contract/settings.py`)", KilnSettings),
)


def _default(field: FieldInfo) -> str:
    # a default computed per machine (the outputs folder under the data home) is documented
    extra = field.json_schema_extra
    if isinstance(extra, dict) and isinstance(extra.get("documented_default"), str):
        return str(extra["documented_default"])
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "(unset)"
    if isinstance(value, list):
        return ",".join(str(item) for item in value) or "(empty)"
    text = str(value)
    if hasattr(value, "get_secret_value"):
        text = value.get_secret_value() or ""
    return '""' if text == "" else text


def render_table(settings: type[BaseSettings]) -> str:
    """One Markdown table: variable, default, meaning (the field's description)."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in settings.model_fields.items():
        variable = f"{prefix}{name}".upper()
        rows.append(f"| `{variable}` | `{_default(field)}` | {field.description or ''} |")
    return "\n".join(rows)


def render_tables() -> str:
    """Every section's heading and table, as they stand between the README markers."""
    parts = [f"**{title}**\n\n{render_table(settings)}" for title, settings in SECTIONS]
    return "\n\n".join(parts)


def readme_tables(text: str) -> str:
    """What README.md holds between the settings-table markers."""
    match = re.search(re.escape(START) + r"\n(.*?)\n" + re.escape(END), text, re.DOTALL)
    assert match, "README.md lost its settings-tables markers"
    return match.group(1).strip()


def main() -> int:
    """Rewrite README's tables from the settings classes."""
    text = README.read_text()
    new = text.replace(readme_tables(text), render_tables())
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
