"""The errors of a batch line: in POST /v1/jobs's shape, and as a refused file reports them.

Each error's `loc` is relative to the line, as `api.job_routes` gives it for one request;
`located` makes it the refused file's (from the body, with the line number).
"""

from __future__ import annotations

from typing import Any

from kiln.tasks.batches.checks import Error
from kiln.tasks.batches.unique_ids import Repeat
from kiln.tasks.contract.batches import CUSTOM_ID_MAX

CUSTOM_ID_MSG = (
    f"custom_id must be 1-{CUSTOM_ID_MAX} letters, digits, '_' or '-', "
    "starting with a letter or digit"
)


def repeat_error(repeat: Repeat) -> Error:
    """The error of a line whose custom_id an earlier line used."""
    msg = f"duplicate custom_id {repeat.custom_id!r}: first used on line {repeat.first_line}"
    return {"type": "duplicate_custom_id", "loc": ["custom_id"], "msg": msg}


def located(number: int, error: Error) -> Error:
    """`error` as the refusal of a file reports it: `loc` from the body, with its line."""
    return {**error, "loc": ["body", "line", number, *error["loc"]], "line": number}


def too_long(limit: int) -> Error:
    """A line over the intake's byte limit."""
    return {"type": "line_too_long", "loc": [], "msg": f"the line is over {limit} bytes"}


def strip_body(error: dict[str, Any]) -> Error:
    """A strict-JSON error of the line (`json_guard`), its `loc` without the leading "body"."""
    loc = list(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    # a line that does not parse says why (json's reason: "Expecting ',' delimiter"), not only that
    reason = (error.get("ctx") or {}).get("error")
    msg = str(reason) if error["type"] == "json_invalid" and reason else error["msg"]
    return {"type": error["type"], "loc": loc, "msg": msg}


def plain_error(error: Any) -> Error:
    """A pydantic error of the line as JSON can carry it."""
    # only what encodes as JSON whatever the input held: type, location, message
    return {"type": str(error["type"]), "loc": list(error["loc"]), "msg": str(error["msg"])}
