"""`kiln usage`: GPU-seconds, energy and attempts per key or pipeline over a time range.

Without `--api` it reads Redis's usage buckets directly (every key's and every node's, as
`kiln admin` sees them); with `--api URL --api-key KEY` it calls /v1/usage, scoped to the key's
own jobs unless it is an admin key. docs/operations.md §21 tells what the figures are.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kiln.tasks.cli.backends import remote_args
from kiln.tasks.cli.exits import UsageError, print_json
from kiln.tasks.contract.usage import GROUP_BY, UsageReport, usage_csv, usage_range


def add_parser(sub: Any) -> None:
    """`kiln usage`."""
    p = sub.add_parser("usage", help="GPU-seconds and energy per key or pipeline over a range")
    p.add_argument(
        "--since", default="24h", help="epoch seconds, ISO 8601 or a duration back (default 24h)"
    )
    p.add_argument("--until", help="as --since (default: now)")
    p.add_argument("--group-by", choices=GROUP_BY, default="key", help="rows per key or pipeline")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--csv", action="store_true", help="print CSV (nodes' idle as @node rows)")
    shown.add_argument("--json", action="store_true", help="print JSON")
    remote_args(p)


def run(args: argparse.Namespace) -> int:
    """Print the range's totals; a malformed range is a usage error (exit 2) naming the flag."""
    try:
        since, until = usage_range(args.since, args.until, time.time())
    except ValueError as exc:
        raise UsageError(f"--{exc}") from None
    report = _remote(args, since, until) if args.api else _direct(args.group_by, since, until)
    if args.csv:
        print(usage_csv(report), end="")
    elif args.json:
        print_json(report.model_dump(mode="json"))
    else:
        print(_describe(report))
    return 0


def _direct(group_by: str, since: float, until: float) -> UsageReport:
    # Deferred: Redis loads only for this command.
    from kiln.storage.usage import usage_totals
    from kiln.tasks.queue.process import ProcessParts

    store = ProcessParts().store
    totals = usage_totals(store, since, until, "key" if group_by == "key" else "pipeline")
    return UsageReport.model_validate(totals, from_attributes=True)


def _remote(args: argparse.Namespace, since: float, until: float) -> UsageReport:
    from kiln.tasks.client.client import KilnClient

    with KilnClient(args.api, api_key=args.api_key) as client:
        return client.usage(since=repr(since), until=repr(until), group_by=args.group_by)


def _describe(report: UsageReport) -> str:
    lines = [f"{'key / pipeline':<28} {'GPU-seconds':>14} {'energy (J)':>12} {'attempts':>9}"]
    for row in report.rows:
        name = row.key_id if report.group_by == "key" else row.pipeline
        energy = "-" if row.energy_j is None else f"{row.energy_j:.1f}"
        lines.append(f"{name or '':<28} {row.gpu_s:>14.3f} {energy:>12} {row.attempts:>9}")
    for node in report.nodes:
        lines.append(
            f"node {node.node_id}: held {node.held_gpu_s:.3f}, busy {node.busy_gpu_s:.3f}, "
            f"idle {node.idle_gpu_s:.3f} GPU-seconds"
        )
    return "\n".join(lines)
