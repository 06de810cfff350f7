r"""Strict JSON request bodies: what Python's `json` accepts but the API cannot use is a 422.

`json.loads` takes `NaN`, `Infinity`, `1e999`, lone UTF-16 surrogates (`"\ud800"`), NUL and
integers of any size. None of them can be stored, echoed or sent on as JSON, so `StrictJsonRoute`
checks a body before FastAPI parses it and names the offending field in FastAPI's 422 shape.
Errors carry no `input`: the very value is what cannot be encoded.
"""

from __future__ import annotations

import email.message
import json
import math
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

MAX_INT = 2**64 - 1
MAX_INT_DIGITS = len(str(MAX_INT))
MAX_ERRORS = 20
_SURROGATE = re.compile("[\ud800-\udfff]")
# a JSON string (skipped whole, brackets inside it do not count) or a bracket
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class _Refused:
    """Stands in for a parsed value the API refuses; the walk reports where it sits."""

    kind: str
    msg: str


_NOT_FINITE = _Refused(
    "finite_number", "Input should be a finite number (NaN and Infinity are not JSON)"
)
_OUT_OF_RANGE = _Refused("int_range", f"Integer is out of range (magnitude above {MAX_INT})")


def _parse_int(text: str) -> int | _Refused:
    # Length first: int() of thousands of digits is slow, and past 4300 it raises.
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _OUT_OF_RANGE
    value = int(text)
    return value if abs(value) <= MAX_INT else _OUT_OF_RANGE


def _parse_float(text: str) -> float | _Refused:
    value = float(text)  # 1e999 parses to inf
    return value if math.isfinite(value) else _NOT_FINITE


def _parse_constant(_text: str) -> _Refused:
    return _NOT_FINITE


def printable(text: str) -> str:
    r"""`text` with each lone surrogate written out as `\udXXX`, so it encodes (in a `loc`, say)."""
    return _SURROGATE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def _string_problem(text: str) -> _Refused | None:
    if _SURROGATE.search(text):
        return _Refused("string_unicode", "Input should be Unicode text (lone UTF-16 surrogate)")
    if "\x00" in text:
        return _Refused("string_nul", "Input should not contain NUL characters")
    return None


def _error(loc: Loc, refused: _Refused) -> dict[str, Any]:
    return {"type": refused.kind, "loc": loc, "msg": refused.msg}


class _Walk:
    """Collects the refused values of a parsed body, with their locations."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.errors: list[dict[str, Any]] = []

    def value(self, value: Any, loc: Loc, depth: int) -> None:
        """Check one value (and what it contains)."""
        if len(self.errors) >= MAX_ERRORS:
            return
        problem = value if isinstance(value, _Refused) else None
        if isinstance(value, str):
            problem = _string_problem(value)
        if problem is not None:
            self.errors.append(_error(loc, problem))
        elif isinstance(value, dict | list):
            self._container(value, loc, depth + 1)

    def _container(self, value: dict[str, Any] | list[Any], loc: Loc, depth: int) -> None:
        if depth > self.max_depth:
            msg = f"JSON is nested deeper than {self.max_depth} levels"
            self.errors.append(_error(loc, _Refused("json_depth", msg)))
            return
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            name: str | int = printable(key) if isinstance(key, str) else key
            problem = _string_problem(key) if isinstance(key, str) else None
            if problem is not None:  # the key itself: named as well as it can be
                self.errors.append(_error((*loc, name), problem))
            else:
                self.value(item, (*loc, name), depth)


def _depth_offset(text: str, max_depth: int) -> int:
    """Where `text` first nests deeper than `max_depth` (0 if it never does)."""
    depth = 0
    for token in _TOKEN.finditer(text):
        bracket = token.group()
        if bracket in ("[", "{"):
            depth += 1
            if depth > max_depth:
                return token.start()
        elif bracket in ("]", "}"):
            depth -= 1
    return 0


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (as its own check does)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


def body_errors(body: bytes, max_depth: int) -> list[dict[str, Any]]:
    """422 errors (FastAPI's shape) for a JSON body the API cannot accept; [] when fine."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [{"type": "json_invalid", "loc": ("body", exc.start), "msg": "Body is not UTF-8"}]
    try:
        parsed = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except RecursionError:
        # deeper than Python's stack allows: find where it crosses the limit without recursing
        msg = f"JSON is nested deeper than {max_depth} levels"
        loc = ("body", _depth_offset(text, max_depth))
        return [{"type": "json_depth", "loc": loc, "msg": msg}]
    except json.JSONDecodeError as exc:
        # Reported here, not left to FastAPI: its parse guesses UTF-16/32 and skips a BOM, so it
        # could accept a body this check never saw.
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error"}
        return [{**error, "ctx": {"error": exc.msg}}]
    walk = _Walk(max_depth)
    walk.value(parsed, ("body",), 0)
    return walk.errors


class StrictJsonRoute(APIRoute):
    """An APIRoute that checks a JSON body with `body_errors` before FastAPI parses it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler, behind the strict check for routes that take a body."""
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def strict(request: Request) -> Response:
            body = await request.body()  # cached on the request: FastAPI reads it from there
            if body and is_json(request.headers.get("content-type")):
                errors = body_errors(body, request.app.state.kiln.settings.max_json_depth)
                if errors:
                    raise RequestValidationError(errors)
            return await handler(request)

        return strict
