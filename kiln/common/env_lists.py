"""How a list setting is read from one environment variable, for every package's settings."""

from __future__ import annotations

import json


def comma_or_json_list(value: object) -> object:
    """`a,b` → ['a', 'b'] and `["a","b"]` → the same; anything but a string is left as it is.

    pydantic-settings reads a `list[str]` environment value as JSON only, so `X=a,b` would be an
    error: each list setting's `mode="before"` validator calls this (with `NoDecode`).
    """
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value
