"""What JSON can carry for a `__call__` parameter, judged from its annotation and default.

A parameter is JSON-safe when its annotation is bool, int, float or str (optional or not, or
`str | list[str]`: one prompt per request), or a `Literal` of such values; typed with PIL images
it is an image input; anything else (tensors, callables, generators, unions of other kinds) is
not. An unannotated parameter, or one whose annotation cannot be resolved, is judged by the type
of its default.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Literal

_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def call_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The parameters of `cls.__call__`, string annotations resolved where they can be."""
    try:
        return dict(inspect.signature(cls.__call__, eval_str=True).parameters)
    except Exception:  # an annotation naming what its module cannot resolve: judged by default
        return dict(inspect.signature(cls.__call__).parameters)


def json_kind(annotation: object, default: object) -> str | list[Any] | None:
    """The JSON type of a parameter: a type name, `image`, an enum's values, or None (unsafe)."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return _TYPE_NAMES.get(type(default)) if default is not None else None
    members = _members(annotation)
    if any(_is_image(member) for member in members):
        return "image"
    literals = [m for m in members if typing.get_origin(m) is Literal]
    if literals:
        values = [v for m in literals for v in typing.get_args(m)]
        return values if len(literals) == len(members) and all(map(json_scalar, values)) else None
    kinds: set[str] = set()
    for member in members:
        if typing.get_origin(member) is list and typing.get_args(member) == (str,):
            continue  # `str | list[str]`: one prompt per request
        if member not in _TYPE_NAMES:
            return None
        kinds.add(_TYPE_NAMES[member])
    if kinds == {"integer", "number"}:
        return "number"
    return kinds.pop() if len(kinds) == 1 else None


def json_scalar(value: object) -> bool:
    """True for what a JSON document holds as a plain value (None, bool, number, string)."""
    return value is None or isinstance(value, (bool, int, float, str))


def _members(annotation: object) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return [m for m in typing.get_args(annotation) if m is not type(None)]
    return [annotation]


def _is_image(annotation: object) -> bool:
    if typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        return any(_is_image(arg) for arg in typing.get_args(annotation))
    return getattr(annotation, "__module__", "").startswith("PIL.")
