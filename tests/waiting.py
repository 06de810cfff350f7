"""Waiting in tests: poll until something holds, and fail naming the last thing seen.

The one polling loop of the suite. A test waits on what the system reports (a state, a count, a
heartbeat field), never on a sleep of a guessed length: the timeout is only how long a shared,
slow machine may take, never a threshold of what is measured.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

GENEROUS_S = 120.0  # a shared 2-core machine can be slow; never a threshold of what we measure
POLL_S = 0.05
_SHOWN_CHARS = 2000  # a long observed value is cut to this in the failure message


def _holds(value: object) -> bool:
    return bool(value)


def wait_until(
    observe: Callable[[], T],
    until: Callable[[T], object] = _holds,
    *,
    timeout_s: float = GENEROUS_S,
    what: str = "",
    poll_s: float = POLL_S,
) -> T:
    """Poll `observe()` until `until(value)` holds; that value, or a failure naming the last one.

    `until` defaults to the value's truth, so `wait_until(lambda: x is None)` works as a predicate
    poll; pass an observation and a test on it (`wait_until(lambda: count(), lambda n: n >= 3)`)
    so that a failure says what was seen rather than "False". An exception from `observe` (for
    instance an assertion that a process is still alive) ends the wait at once.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        seen = observe()
        if until(seen):
            return seen
        if time.monotonic() >= deadline:
            shown = repr(seen)
            if len(shown) > _SHOWN_CHARS:
                shown = shown[:_SHOWN_CHARS] + "…"
            name = what or getattr(observe, "__qualname__", "the condition")
            raise AssertionError(f"not within {timeout_s:g} s: {name}; last seen: {shown}")
        time.sleep(poll_s)


def wait_for_changes(
    observe: Callable[[], object],
    count: int = 2,
    *,
    timeout_s: float = GENEROUS_S,
    what: str = "",
) -> None:
    """Wait until `observe()` has changed `count` times from its value now.

    The positive signal a "nothing happens" check waits on instead of a sleep: a timestamp or
    counter the system writes each time it looks (a heartbeat's deadline, an audit's claim)
    moving on proves it has looked since, however slow the machine. A change missed between two
    polls only makes the wait longer.
    """
    values = [observe()]

    def changes() -> int:
        value = observe()
        if value != values[-1]:
            values.append(value)
        return len(values) - 1

    wait_until(changes, lambda seen: seen >= count, timeout_s=timeout_s, what=what)


def wait_for_line(
    path: Path,
    text: str,
    process: subprocess.Popen[bytes] | None = None,
    *,
    timeout_s: float = GENEROUS_S,
) -> str:
    """The first line of the file at `path` containing `text`, once written.

    Fails at once if `process` (the one writing the file) exits without writing it.
    """

    def first_line() -> str | None:
        exited = process is not None and process.poll() is not None  # before the read: no race
        lines = path.read_text(errors="replace").splitlines()
        found = next((line for line in lines if text in line), None)
        assert found is not None or not exited, f"the process exited with no line with {text!r}"
        return found

    try:
        line = wait_until(first_line, timeout_s=timeout_s, poll_s=0.1, what=f"a line with {text!r}")
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{tail(path)}") from None
    assert line is not None
    return line


def tail(path: Path, chars: int = 4000) -> str:
    """The end of a log file, for a failure's message."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path}: no file)"
