"""`kiln control`: the cluster's loops alone, a CPU-only process (tasks/control/process.py)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    """`kiln control [--loglevel LEVEL]`."""
    c = sub.add_parser(
        "control",
        help="run the cluster's loops (reaper, sweeper, audits, pruner, batch feeder) alone, "
        "beside nodes started with KILN_NODE_CONTROL_LOOPS=false",
    )
    c.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def run(args: argparse.Namespace) -> int:
    """Run `kiln control` until SIGTERM or SIGINT; 0 then."""
    # Deferred: Redis, Celery and boto3 load only for this command.
    from kiln.common.tracing import start_tracing
    from kiln.storage.base import require_supported_redis
    from kiln.tasks.control.process import run_control
    from kiln.tasks.queue.process import start_process

    parts = start_process()
    require_supported_redis(parts.storage_settings)  # one line, before anything starts
    start_tracing("kiln-control")  # its feeders' line jobs' admission spans, where OTEL_* asks
    run_control(parts, args.loglevel)
    return 0
