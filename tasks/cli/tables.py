"""How the CLI's tables read: whole ids and states, numbers and nested metrics as words.

A table is drawn to the terminal's width (80 columns when there is none): what a user copies
back into a command (ids, states, paths) is never cut short; long values wrap instead.
"""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table


def fitting_table(*columns: str, whole: tuple[str, ...] = (), cut: tuple[str, ...] = ()) -> Table:
    """A table with a header, two spaces between columns.

    The `whole` columns are never wrapped nor cut; the `cut` ones (free text such as a prompt)
    end in `…` when the line is full; the others wrap.
    """
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for name in columns:
        if name in whole:
            table.add_column(name, no_wrap=True, min_width=len(name))
        elif name in cut:
            table.add_column(name, no_wrap=True, overflow="ellipsis")
        else:
            table.add_column(name, overflow="fold")
    return table


def age_text(seconds: float) -> str:
    """A duration as its largest unit: `45s`, `12m`, `3h`, `2d`."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def whole_width(table: Table, column: int, values: list[str]) -> None:
    """Widen `column` to its longest value, so rich squeezes the other columns first."""
    header = str(table.columns[column].header)
    table.columns[column].min_width = max([len(value) for value in values] + [len(header)])


def metric_text(name: str, value: Any) -> str:
    """A job metric as a person reads it: `speed` in words, other objects as `key value` pairs."""
    if name == "speed" and isinstance(value, dict):
        return speed_text(value)
    if isinstance(value, dict):
        return ", ".join(f"{key} {metric_text(key, item)}" for key, item in value.items())
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def speed_text(speed: dict[str, Any]) -> str:
    """`fast: 12 of 40 block calls skipped (first_block cache, threshold 0.1)`."""
    text = str(speed.get("mode", "?"))
    calls, skipped = speed.get("block_calls"), speed.get("block_calls_skipped")
    if calls:
        text += f": {skipped or 0} of {calls} block calls skipped"
    cache = speed.get("cache")
    if cache and cache != "none":
        text += f" ({cache} cache, threshold {speed.get('threshold', 0):g})"
    if speed.get("tf32"):
        text += ", TF32"
    return text
