"""Usage totals over a time range from hourly buckets (kiln/common/ledger.py, operations §21).

One hash per hour of the deployment, `<ns>:usage:<hour start, epoch s>`, kept USAGE_RETENTION_S
after its last write. Its fields:

- `<owner key id>/<pipeline>/gpu_s|energy_j|attempts`: added by the transition that closes an
  attempt (storage/lua/_machine.lua `account_usage`), in the hour of its end by the Redis clock;
  `-` is the owner of a job submitted without a key (auth off);
- `@node/<node id>/held_gpu_s|busy_gpu_s`: added by each node's heartbeat (its growth since the
  one before, tasks/node/usage.py), in the hour of the heartbeat by the node's clock; idle is
  held - busy.

A range reads the buckets of the hours it touches (`since` rounded down to its hour), so a total
never scans job records; it is exact to the hour.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

from kiln.common.ledger import USAGE_BUCKET_S, USAGE_RETENTION_S
from kiln.storage.base import StoreBase
from kiln.storage.boundary import redis_boundary

NODE_PREFIX = "@node/"  # a key id never starts with '@'
GroupBy = Literal["key", "pipeline"]
GROUP_BY: tuple[GroupBy, ...] = ("key", "pipeline")


def usage_bucket(store: StoreBase, hour: int) -> str:
    """The hash of the hour starting at `hour` (epoch seconds, a multiple of USAGE_BUCKET_S)."""
    return store.keys.usage(str(hour))


def bucket_hours(since: float, until: float) -> list[int]:
    """The hours whose buckets a range [since, until) reads."""
    first = math.floor(since / USAGE_BUCKET_S) * USAGE_BUCKET_S
    return list(range(int(first), math.ceil(until), USAGE_BUCKET_S))


@dataclass
class UsageRow:
    """One key's or one pipeline's totals over a range."""

    key_id: str | None
    pipeline: str | None
    gpu_s: float = 0.0
    energy_j: float | None = None
    attempts: int = 0


@dataclass
class NodeUsage:
    """One node's own GPU-seconds over a range: held warm, busy with batches, and idle."""

    node_id: str
    held_gpu_s: float = 0.0
    busy_gpu_s: float = 0.0

    @property
    def idle_gpu_s(self) -> float:
        """Held with no batch on the group."""
        return max(0.0, self.held_gpu_s - self.busy_gpu_s)


@dataclass
class UsageTotals:
    """A range's totals: rows by key or pipeline (sorted), and the nodes' own."""

    since: float
    until: float
    group_by: GroupBy
    rows: list[UsageRow] = field(default_factory=list)
    nodes: list[NodeUsage] = field(default_factory=list)


@redis_boundary
def usage_totals(
    store: StoreBase, since: float, until: float, group_by: GroupBy, owner: str | None = None
) -> UsageTotals:
    """Totals over the hours of [since, until); `owner` given: that key's jobs only, no nodes."""
    hours = bucket_hours(since, until)
    with store.redis.pipeline(transaction=False) as pipe:
        for hour in hours:
            pipe.hgetall(usage_bucket(store, hour))
        buckets: list[dict[str, str]] = pipe.execute()
    rows: dict[str, UsageRow] = {}
    nodes: dict[str, NodeUsage] = {}
    for bucket in buckets:
        for name, value in bucket.items():
            if name.startswith(NODE_PREFIX):
                if owner is None:
                    _add_node(nodes, name[len(NODE_PREFIX) :], float(value))
                continue
            key_id, _, rest = name.partition("/")
            pipeline, _, figure = rest.rpartition("/")
            if not pipeline or (owner is not None and key_id != owner):
                continue
            group = key_id if group_by == "key" else pipeline
            row = rows.setdefault(
                group,
                UsageRow(
                    key_id if group_by == "key" else None, pipeline if group_by != "key" else None
                ),
            )
            _add_figure(row, figure, value)
    return UsageTotals(
        since,
        until,
        group_by,
        rows=[rows[name] for name in sorted(rows)],
        nodes=[nodes[name] for name in sorted(nodes)],
    )


def _add_figure(row: UsageRow, figure: str, value: str) -> None:
    if figure == "gpu_s":
        row.gpu_s += float(value)
    elif figure == "energy_j":
        row.energy_j = (row.energy_j or 0.0) + float(value)
    elif figure == "attempts":
        row.attempts += int(value)


def _add_node(nodes: dict[str, NodeUsage], rest: str, value: float) -> None:
    node_id, _, figure = rest.rpartition("/")
    node = nodes.setdefault(node_id, NodeUsage(node_id))
    if figure == "held_gpu_s":
        node.held_gpu_s += value
    elif figure == "busy_gpu_s":
        node.busy_gpu_s += value


@redis_boundary
def add_node_usage(
    store: StoreBase, node_id: str, held_gpu_s: float, busy_gpu_s: float, at: float | None = None
) -> None:
    """A node's GPU-seconds held and busy since its last report, in the hour of `at` (now)."""
    if held_gpu_s <= 0 and busy_gpu_s <= 0:
        return
    now = time.time() if at is None else at
    bucket = usage_bucket(store, int(now // USAGE_BUCKET_S) * USAGE_BUCKET_S)
    with store.redis.pipeline(transaction=True) as pipe:
        pipe.hincrbyfloat(bucket, f"{NODE_PREFIX}{node_id}/held_gpu_s", max(0.0, held_gpu_s))
        pipe.hincrbyfloat(bucket, f"{NODE_PREFIX}{node_id}/busy_gpu_s", max(0.0, busy_gpu_s))
        pipe.expire(bucket, USAGE_RETENTION_S)
        pipe.execute()
