"""Log lines of a rank process, in the format its node uses (`GroupConfig.log_format`).

A rank writes to its inherited stderr, which is the node's: with `json`, one JSON object per line
(time, level, logger, message, `node_id`, `rank`, and during a forward the `job_id` of each
request in it and the coordinator's `forward` number); with `text`, one readable line. gpu_worker
never reads the tasks package's settings: the node passes the format down in the group's config.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter
from typing_extensions import override

TEXT_FORMAT = "[%(asctime)s: %(levelname)s/rank%(rank)s] %(name)s: %(message)s"
_EMPTY: MappingProxyType[str, Any] = MappingProxyType({})
_forward: ContextVar[MappingProxyType[str, Any]] = ContextVar("kiln_rank_forward", default=_EMPTY)


class RankJsonFormatter(JsonFormatter):
    """time, level, logger, message first, then every extra field of the record."""

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            reserved_attrs=[*RESERVED_ATTRS, "color_message", "taskName"],
        )

    @override
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """ISO 8601 in UTC, to the millisecond."""
        return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


class RankFields(logging.Filter):
    """Adds the node id, the rank and the running forward's fields to every record."""

    def __init__(self, node_id: str, rank: int) -> None:
        super().__init__()
        self._static = {"node_id": node_id, "rank": rank}

    def filter(self, record: logging.LogRecord) -> bool:
        """Set the fields the record does not carry yet; never drops a record."""
        for key, value in (*_forward.get().items(), *self._static.items()):
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def configure_rank_logging(log_format: str, level: str, *, node_id: str, rank: int) -> None:
    """Make this rank's root logger write `log_format` lines to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(RankJsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    handler.addFilter(RankFields(node_id, rank))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)


@contextlib.contextmanager
def forward_fields(forward: int, job_ids: Sequence[str]) -> Iterator[None]:
    """Records logged inside carry the forward's number and its jobs (`job_id` when one)."""
    fields: dict[str, Any] = {"forward": forward}
    if len(job_ids) == 1:
        fields["job_id"] = job_ids[0]
    else:
        fields["job_ids"] = list(job_ids)
    token = _forward.set(MappingProxyType(fields))
    try:
        yield
    finally:
        _forward.reset(token)
