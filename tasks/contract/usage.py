"""`GET /v1/usage` and `kiln usage`: GPU-seconds, energy and attempts per key or pipeline.

What the totals are and how they are kept: kiln/common/ledger.py and storage/usage.py
(docs/operations.md §21). The range's ends are read here, once, for the API and the CLI alike:
epoch seconds, an ISO 8601 time, or a duration back from now (`90s`, `30m`, `24h`, `7d`).
"""

from __future__ import annotations

import datetime
import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.common.ledger import USAGE_RETENTION_S

GroupBy = Literal["key", "pipeline"]
GROUP_BY: tuple[str, ...] = ("key", "pipeline")
DEFAULT_SINCE = "24h"
LATEST_INSTANT = 253402300799.0  # 9999-12-31T23:59:59Z: later is a mistake, not a time
MAX_RANGE_S = USAGE_RETENTION_S  # older buckets are gone: a longer range would read nothing
_DURATION = re.compile(r"^(\d{1,9})([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_instant(text: str, now: float) -> float:
    """Epoch seconds of `text`: epoch seconds, ISO 8601, or a duration before `now`.

    Raises ValueError saying what is wrong (NaN, infinite, negative, past year 9999, unreadable).
    """
    value = text.strip()
    back = _DURATION.match(value)  # a duration: that long before now
    try:
        instant = now - int(back.group(1)) * _UNIT_S[back.group(2)] if back else float(value)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                f"{text[:40]!r} is not epoch seconds, an ISO 8601 time or a duration like 24h"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.UTC)
        instant = moment.timestamp()
    if not math.isfinite(instant):
        raise ValueError(f"{text[:40]!r} is not a finite time")
    if not 0 <= instant <= LATEST_INSTANT:
        raise ValueError(f"{text[:40]!r} is out of range (0 to {LATEST_INSTANT:.0f} epoch seconds)")
    return instant


def usage_range(since: str | None, until: str | None, now: float) -> tuple[float, float]:
    """The range [since, until) a usage query asks for; ValueError naming the bad end.

    The message starts with the parameter's name (`since: ...`), so both doors can name it.
    """
    try:
        start = parse_instant(since or DEFAULT_SINCE, now)
    except ValueError as exc:
        raise ValueError(f"since: {exc}") from None
    try:
        end = parse_instant(until, now) if until else now
    except ValueError as exc:
        raise ValueError(f"until: {exc}") from None
    if start >= end:
        raise ValueError(f"since: {start:.0f} is not before until ({end:.0f})")
    if end - start > MAX_RANGE_S:
        days = MAX_RANGE_S // 86400
        raise ValueError(f"since: the range is longer than the {days} days usage is kept")
    return start, end


class UsageRowView(BaseModel):
    """One key's or one pipeline's totals (the other of `key_id` and `pipeline` is null)."""

    model_config = ConfigDict(from_attributes=True)

    key_id: str | None = Field(description="The owner key id ('-': jobs without a key).")
    pipeline: str | None
    gpu_s: float = Field(description="GPU-seconds its jobs' attempts occupied.")
    energy_j: float | None = Field(description="Joules (null: not measured on these devices).")
    attempts: int = Field(description="Attempts that ended in the range.")


class NodeUsageView(BaseModel):
    """A node's own GPU-seconds: held warm (devices × time), busy with batches, idle."""

    model_config = ConfigDict(from_attributes=True)

    node_id: str
    held_gpu_s: float
    busy_gpu_s: float
    idle_gpu_s: float


class UsageReport(BaseModel):
    """Totals over [since, until), by whole hours (docs/operations.md §21)."""

    model_config = ConfigDict(from_attributes=True)

    since: float
    until: float
    group_by: GroupBy
    rows: list[UsageRowView]
    nodes: list[NodeUsageView] = Field(
        default_factory=list,
        description="Every node's held, busy and idle GPU-seconds: admin keys only.",
    )


CSV_COLUMNS = ("key_id", "pipeline", "gpu_s", "energy_j", "attempts")


def usage_csv(report: UsageReport) -> str:
    """The report's rows as CSV (a header, one line per row; the nodes as `@node/<id>` rows)."""
    lines = [",".join(CSV_COLUMNS)]
    for row in report.rows:
        energy = "" if row.energy_j is None else f"{row.energy_j:.6f}"
        key_id, pipeline = row.key_id or "", row.pipeline or ""
        lines.append(f"{_cell(key_id)},{_cell(pipeline)},{row.gpu_s:.6f},{energy},{row.attempts}")
    for node in report.nodes:
        lines.append(f"@node/{_cell(node.node_id)},idle,{node.idle_gpu_s:.6f},,0")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    # ids and pipeline names hold no comma or quote; a value that did is quoted, as CSV does
    if any(c in text for c in ',"\n'):
        return '"' + text.replace('"', '""') + '"'
    return text
