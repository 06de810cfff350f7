"""Small named policies of a job run: retry backoff and the error shape of a failure."""

from __future__ import annotations

import re
from typing import Any

from kiln.tasks.contract.backoff import doubling_delay, equal_jitter
from kiln.tasks.contract.settings import KilnSettings


def retry_delay(attempt: int, settings: KilnSettings) -> float:
    """Delay before re-publishing a job after failed attempt n: from [d/2, d] (docs §5).

    d = min(KILN_RETRY_BACKOFF_S · 2^(n-1), KILN_RETRY_BACKOFF_MAX_S).
    """
    ceiling = doubling_delay(attempt, settings.retry_backoff_s, settings.retry_backoff_max_s)
    return equal_jitter(ceiling)


_TRACEBACK = "Traceback (most recent call last):"
# An absolute file path on the server: not part of a URL (`://host/a`) or an object key (`a/b`).
_SERVER_PATH = re.compile(r"(?<![\w:/.~-])~?(?:/[\w.+@~-]+){2,}/?")
# the longest message a job's error keeps (an out-of-memory advice is about 400 characters)
MAX_ERROR_MESSAGE = 1000


def public_message(text: str) -> str:
    """One line of an error for a job's view: no traceback, no server file path.

    A traceback is reduced to its last line (the exception raised); a path to its file name. The
    node logs the full text where it has it (`gpu_worker.failures`, the attempt's own log).
    """
    head, _, traceback = text.partition(_TRACEBACK)
    lines = [line.strip() for line in head.splitlines() if line.strip()]
    raised = [line.strip() for line in traceback.splitlines() if line.strip()]
    if raised:
        lines.append(raised[-1])
    one_line = " ".join(lines)
    one_line = _SERVER_PATH.sub(lambda path: path.group(0).rstrip("/").rsplit("/", 1)[-1], one_line)
    if len(one_line) > MAX_ERROR_MESSAGE:
        one_line = one_line[: MAX_ERROR_MESSAGE - 1] + "…"
    return one_line


def error_dict(exc: BaseException) -> dict[str, Any]:
    """The job view's `error` for an exception: its type, message and whether a retry may help.

    The message is one line without tracebacks or server paths (`public_message`).
    """
    return {
        "type": type(exc).__name__,
        "message": public_message(str(exc)) or type(exc).__name__,
        "retryable": bool(getattr(exc, "retryable", False)),
    }
