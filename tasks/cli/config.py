"""`kiln config`, and the check of the `KILN_*` environment that runs before every command."""

from __future__ import annotations

import argparse
from typing import Any

from kiln.settings_check import (
    PREFIX,
    UnknownSetting,
    closest_setting,
    effective_settings,
    setting_names,
)
from kiln.settings_check import check_environment as check_names
from kiln.tasks.cli.exits import UsageError, print_json


def check_environment() -> None:
    """Stop the command (exit 2, one line) on a `KILN_*` variable that is no known setting."""
    try:
        check_names()
    except UnknownSetting as exc:
        raise UsageError(str(exc)) from None


def add_parser(sub: Any) -> None:
    """`kiln config [--set NAME=VALUE ...] [--json]`."""
    p = sub.add_parser(
        "config",
        help="print the effective settings, where each came from (default, environment, flag)",
        description="Print every KILN_* setting as a command would use it, secrets masked, "
        "with its source: default, environment, or flag (--set, standing for a command's flag "
        "such as `kiln api --port`).",
    )
    p.add_argument(
        "--set",
        dest="flags",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="take this value as a command-line flag would give it (repeatable), e.g. "
        "KILN_API_PORT=9000 or api_port=9000 (default: none)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def parse_flags(values: list[str]) -> dict[str, str]:
    """`--set NAME=VALUE` options → {field: value}; an unknown NAME is a usage error."""
    fields = setting_names()
    flags: dict[str, str] = {}
    for value in values:
        name, sep, text = value.partition("=")
        variable = name.strip().upper()
        if not variable.startswith(PREFIX):
            variable = PREFIX + variable
        if not sep or variable not in fields:
            guess = closest_setting(variable) if sep else None
            hint = f" (did you mean {guess}?)" if guess else ""
            raise UsageError(f"--set {value!r}: expected NAME=VALUE with a known setting{hint}")
        flags[fields[variable][1]] = text
    return flags


def run(args: argparse.Namespace) -> int:
    """Print the effective settings."""
    rows = effective_settings(flags=parse_flags(args.flags))
    if args.json:
        print_json([{"name": r.name, "value": r.value, "source": r.source} for r in rows])
        return 0
    width = max(len(r.name) for r in rows)
    for row in rows:
        print(f"{row.name:<{width}}  {row.source:<11}  {row.value}")
    return 0
