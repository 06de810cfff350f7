"""How Kiln's processes write log lines: text, or one JSON object per line (`KILN_LOG_FORMAT`).

Every process uses it: the API, the webhook workers and a node (`kiln.tasks`), and a node's rank
processes (`kiln.gpu_worker.logs`, which add their rank and the running forward's fields).

A JSON line carries `time` (ISO 8601, UTC), `level`, `logger` and `message`, then `job_id`,
`node_id`, `attempt` and `batch_id` where known, and any other extra field of the record
(`exc_info` with the traceback). Known means: passed as `extra=` on the call, set by
`log_context` around the code that logs (the node's JobRunner around a job; context variables, so
per thread), or set for the whole process in `configure_logging(static=...)` (a node's id).

With `capture_stdio`, whatever else reaches the process's file descriptors 1 and 2 (a `print`, a
C library's warning, a child process's traceback, Celery's shutdown notice) becomes a JSON line
too, so every line of the output parses; lines that already are JSON objects (a rank's log lines,
written to the stderr it inherits) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType, TracebackType
from typing import Any, TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter
from typing_extensions import override

CONTEXT_FIELDS = ("job_id", "node_id", "attempt", "batch_id")
TEXT_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(name)s: %(message)s"
_EMPTY: MappingProxyType[str, Any] = MappingProxyType({})
_context: ContextVar[MappingProxyType[str, Any]] = ContextVar("kiln_log_context", default=_EMPTY)


class KilnJsonFormatter(JsonFormatter):
    """time, level, logger, message first, then the context and every other extra field."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            # uvicorn's `color_message` repeats the message with terminal colours
            reserved_attrs=[*RESERVED_ATTRS, "color_message", "taskName"],
        )

    @override
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """ISO 8601 in UTC, to the millisecond."""
        return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


class ContextFilter(logging.Filter):
    """Adds the context's fields, then the process's static ones, to records lacking them."""

    def __init__(self, static: Mapping[str, object] | None = None) -> None:
        super().__init__()
        self._static = {k: v for k, v in (static or {}).items() if v is not None}

    def filter(self, record: logging.LogRecord) -> bool:
        """Set the fields the record does not carry yet; never drops a record."""
        for key, value in (*_context.get().items(), *self._static.items()):
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def bind_log_context(**fields: object) -> Token[MappingProxyType[str, Any]]:
    """Add fields (None ones skipped) to the current context; undo with `reset_log_context`."""
    added = {key: value for key, value in fields.items() if value is not None}
    return _context.set(MappingProxyType({**_context.get(), **added}))


def reset_log_context(token: Token[MappingProxyType[str, Any]]) -> None:
    """Undo the `bind_log_context` that returned `token`."""
    _context.reset(token)


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Records logged inside (on this thread or task) carry these fields."""
    token = bind_log_context(**fields)
    try:
        yield
    finally:
        reset_log_context(token)


def make_handler(
    log_format: str,
    stream: TextIO,
    static: Mapping[str, object] | None = None,
    text_format: str = TEXT_FORMAT,
) -> logging.Handler:
    """A handler writing `log_format` lines to `stream`, with the context filter on."""
    handler = logging.StreamHandler(stream)
    if log_format == "json":
        handler.setFormatter(KilnJsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(text_format))
    handler.addFilter(ContextFilter(static))
    return handler


def configure_logging(
    log_format: str,
    level: str | int = "INFO",
    *,
    static: Mapping[str, object] | None = None,
    stream: TextIO | None = None,
    text_format: str = TEXT_FORMAT,
) -> logging.Handler:
    """Make the root logger's one handler write `log_format` lines to `stream` (stderr)."""
    handler = make_handler(log_format, stream or sys.stderr, static, text_format)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    logging.captureWarnings(True)
    return handler


def is_json_object(line: str) -> bool:
    """True when `line` is one JSON object (a log line someone else already formatted)."""
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


class StdioCapture:
    """File descriptors 1 and 2 read by two threads that log each line (see the module doc)."""

    def __init__(self, handler: logging.Handler, stream: TextIO) -> None:
        self._handler = handler
        self._stream = stream
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Point fds 1 and 2 at pipes (children started later inherit them) and read them."""
        for fd, name, level in ((1, "stdout", logging.INFO), (2, "stderr", logging.WARNING)):
            read_fd, write_fd = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_fd, fd)
            os.close(write_fd)
            thread = threading.Thread(
                target=self._pump,
                args=(read_fd, logging.getLogger(name), level),
                name=f"kiln-{name}-capture",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 2.0) -> None:
        """Give fds 1 and 2 back and log what is left in the pipes (children should be gone)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved.clear()
        deadline = time.monotonic() + timeout_s  # one wait for both streams, not one each
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _pump(self, read_fd: int, logger: logging.Logger, level: int) -> None:
        with open(read_fd, "rb") as pipe:
            for raw in pipe:
                line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                if not line.strip():
                    continue
                if is_json_object(line):
                    self._write_raw(line)
                else:
                    logger.log(level, line)

    def _write_raw(self, line: str) -> None:
        self._handler.acquire()
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        finally:
            self._handler.release()


def start_json_logging(
    level: str | int = "INFO", static: Mapping[str, object] | None = None
) -> StdioCapture:
    """JSON lines for this process and its children: root handler on the real stderr, fds captured.

    Call `stop()` on the result before the process exits, after its children are gone.
    """
    stream = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    handler = configure_logging("json", level, static=static, stream=stream)
    capture = StdioCapture(handler, stream)
    capture.start()
    sys.excepthook = _log_uncaught  # a crash's traceback is a JSON line too
    threading.excepthook = _log_thread_uncaught
    return capture


def _log_uncaught(
    kind: type[BaseException], value: BaseException, traceback: TracebackType | None
) -> None:
    logging.getLogger("kiln").critical("uncaught exception", exc_info=(kind, value, traceback))


def _log_thread_uncaught(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("kiln").error(
        "uncaught exception in thread %s",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
