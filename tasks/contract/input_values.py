"""One value of a request's `inputs` against its property in a pipeline's input schema.

The subset of JSON Schema the pipelines use, for the scalar values `inputs` holds: `type` (a name
or a list), `enum`, `const`, `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`,
`multipleOf`, `minLength`, `maxLength`, `pattern`. The object's own keywords (`properties`,
`required`, `additionalProperties`) are applied by `contract.inputs`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_JSON_TYPES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    type(None): "null",
}


def value_violation(value: Any, prop: Mapping[str, Any]) -> tuple[str, str] | None:
    """(rule, what it asks) for the first keyword of `prop` that `value` breaks, else None."""
    for check in (_type, _enum, _const, _number, _string):
        broken = check(value, prop)
        if broken is not None:
            return broken
    return None


def json_type(value: Any) -> str:
    """The JSON type name of a scalar (`integer` for ints, never for bools)."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _type(value: Any, prop: Mapping[str, Any]) -> tuple[str, str] | None:
    wanted = prop.get("type")
    if wanted is None:
        return None
    names = [wanted] if isinstance(wanted, str) else list(wanted)
    actual = json_type(value)
    if actual in names or (actual == "integer" and "number" in names):
        return None
    if actual == "number" and "integer" in names and float(value).is_integer():
        return None  # 2.0 is an integer in JSON Schema
    return "type", f"as {' or '.join(names)}"


def _same(left: Any, right: Any) -> bool:
    # JSON equality: True is not 1, but 1 is 1.0.
    if isinstance(left, bool) or isinstance(right, bool):
        return type(left) is type(right) and left == right
    return bool(left == right) and (
        type(left) is type(right)
        or (isinstance(left, (int, float)) and isinstance(right, (int, float)))
    )


def _enum(value: Any, prop: Mapping[str, Any]) -> tuple[str, str] | None:
    options = prop.get("enum")
    if options is None or any(_same(value, option) for option in options):
        return None
    shown = ", ".join(map(str, options[:20])) + (", …" if len(options) > 20 else "")
    return "enum", f"as one of {shown}"


def _const(value: Any, prop: Mapping[str, Any]) -> tuple[str, str] | None:
    if "const" not in prop or _same(value, prop["const"]):
        return None
    return "const", f"= {prop['const']!r}"


def _number(value: Any, prop: Mapping[str, Any]) -> tuple[str, str] | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for keyword, sign in _BOUNDS:
        limit = prop.get(keyword)
        if isinstance(limit, (int, float)) and not _within(value, sign, limit):
            return keyword, f"{sign} {_number_text(limit)}"
    multiple = prop.get("multipleOf")
    if isinstance(multiple, (int, float)) and multiple > 0:
        quotient = value / multiple
        if not math.isclose(quotient, round(quotient), rel_tol=0, abs_tol=1e-9):
            return "multipleOf", f"as a multiple of {_number_text(multiple)}"
    return None


_BOUNDS = (("minimum", "≥"), ("maximum", "≤"), ("exclusiveMinimum", ">"), ("exclusiveMaximum", "<"))


def _within(value: float, sign: str, limit: float) -> bool:
    if sign == "≥":
        return value >= limit
    if sign == "≤":
        return value <= limit
    return value > limit if sign == ">" else value < limit


def _number_text(number: float) -> str:
    # 1.0 reads as 1; a big integer stays exact
    return str(number) if isinstance(number, int) else f"{number:g}"


def _string(value: Any, prop: Mapping[str, Any]) -> tuple[str, str] | None:
    if not isinstance(value, str):
        return None
    shortest, longest = prop.get("minLength"), prop.get("maxLength")
    if isinstance(shortest, int) and len(value) < shortest:
        return "minLength", f"of at least {shortest} characters"
    if isinstance(longest, int) and len(value) > longest:
        return "maxLength", f"of at most {longest} characters"
    pattern = prop.get("pattern")
    if isinstance(pattern, str) and re.search(pattern, value) is None:
        return "pattern", f"matching {pattern}"
    return None
