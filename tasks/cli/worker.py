"""`kiln worker`: its arguments, the checks made right after them, and the run.

A pipeline the node could not serve is refused in one line, exit 2: an unknown spec, a missing
diffusers folder, a `python:` module that is not found or fails to import, a factory that is
missing, takes no device, does not say what it makes or says it makes no pipeline. `cli.main`
runs `check_arguments` right after parsing, before the settings check, Redis, Celery, torch or
the node's modules load: only what the user's own module imports is loaded for it. This module
and what it imports at its top load nothing heavy, and `cli.main` builds only this command's
parser for `kiln worker`.

What only loading shows (a factory declared to return a `Pipeline` that returns something
else) is found by the ranks: the start ends with the same one line and exit 2, as soon as
rank 0 has tried to load it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kiln.common.defaults import BATCH_WINDOW_S, MAX_BATCH
from kiln.common.request import Lane
from kiln.tasks.cli.exits import EXIT_JOB_FAILED, UsageError
from kiln.tasks.node.worker_options import check_pipelines, parse_lanes, parse_pipelines


def add_parser(sub: Any) -> None:
    """`kiln worker ...`."""
    w = sub.add_parser("worker", help="run a node worker (or a webhooks worker)")
    w.add_argument("--pipeline", action="append", default=[], help="NAME or NAME=SPEC; repeatable")
    w.add_argument("--devices", default="cpu:1", help="cpu:N or cuda:0,cuda:1")
    w.add_argument("--queues", default=",".join(Lane), help="lanes, in priority order")
    w.add_argument("--max-batch", type=int, default=MAX_BATCH, help="most jobs run together")
    w.add_argument(
        "--batch-window-ms",
        type=float,
        default=BATCH_WINDOW_S * 1000,
        help="how long an idle group waits for compatible jobs to batch with the first "
        "(jobs that queue up while the group is busy are batched anyway)",
    )
    w.add_argument(
        "--parallel",
        choices=["auto", "none", "batch", "context"],
        default="auto",
        help="how ranks share a job: auto = split batch rows, context parallel where the model "
        "has a plan (none is for one device)",
    )
    w.add_argument(
        "--group-size",
        type=int,
        help="ranks per replica group: the devices split into independent groups of this many "
        "ranks, each job going to the least busy group (default: one group over all devices)",
    )
    _add_sleep_and_compile(w)
    w.add_argument(
        "--lora-dir",
        type=Path,
        help="LoRA adapters jobs may name: DIR/<pipeline>/<name>/pytorch_lora_weights.safetensors "
        "(default: KILN_LORA_DIR, else none)",
    )
    w.add_argument(
        "--concurrency",
        type=int,
        help="Celery worker threads (default: 2 x --max-batch per replica group)",
    )
    w.add_argument("--webhooks", action="store_true", help="also deliver webhooks")
    w.add_argument("--node-id", help="this node's id (default: <hostname>-<pid>)")
    w.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def _add_sleep_and_compile(w: argparse.ArgumentParser) -> None:
    """`kiln worker` flags over KILN_IDLE_SLEEP_S, KILN_SLEEP_MODE, KILN_COMPILE, KILN_WARMUP."""
    w.add_argument(
        "--idle-sleep-s",
        type=float,
        help="after this many seconds without work, release the pipelines' memory until the next "
        "job (default: KILN_IDLE_SLEEP_S, else never)",
    )
    w.add_argument(
        "--sleep-mode",
        choices=["offload", "drop"],
        help="offload: modules to host memory; drop: delete, reload from disk on wake",
    )
    w.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="wrap each denoiser in torch.compile, caches in KILN_COMPILE_CACHE_DIR",
    )
    w.add_argument(
        "--warmup",
        action="append",
        default=[],
        metavar="WxHxSTEPS[xFRAMES]",
        help="a shape to run (and compile) before taking jobs; repeatable",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse (`UsageError`, one line) what the command line alone shows to be wrong.

    The pipelines first (`check_pipelines`: their forms, the worker extra, each `python:` module
    imported and its factory looked at); loads nothing of Kiln's node, no torch of its own.
    """
    if args.max_batch < 1:
        raise UsageError("--max-batch must be at least 1")
    try:
        parse_lanes(args.queues)
        check_pipelines(parse_pipelines(args.pipeline))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run `kiln worker` (its arguments checked by `check_arguments` already)."""
    # Deferred, all of them: `check_arguments` must refuse before any of it loads.
    from kiln.storage.base import require_supported_redis
    from kiln.tasks.node.worker import PipelineFailed, PipelineRefused, WorkerOptions, run_worker
    from kiln.tasks.queue.process import start_process

    # one line, before torch and Celery load (run_worker takes the parts started here)
    require_supported_redis(start_process().storage_settings)
    try:
        options = WorkerOptions(
            pipelines=parse_pipelines(args.pipeline),
            devices=args.devices,
            lanes=parse_lanes(args.queues),
            max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms,
            parallel=args.parallel,
            concurrency=args.concurrency,
            webhooks=args.webhooks,
            node_id=args.node_id,
            loglevel=args.loglevel,
            group_size=args.group_size,
            lora_dir=args.lora_dir,
            idle_sleep_s=args.idle_sleep_s,
            sleep_mode=args.sleep_mode,
            compile=args.compile,
            warmup=tuple(args.warmup),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    try:
        run_worker(options)
    except PipelineRefused as exc:  # rank 0 could not load it: said as the checks above say it
        raise UsageError(f"--pipeline {exc.name}: {exc.reason}") from None
    except PipelineFailed as exc:  # its model or code raised loading or warming up (as `check`)
        print(f"kiln: --pipeline {exc.name}: {exc.reason}", file=sys.stderr)
        return EXIT_JOB_FAILED
    return 0
