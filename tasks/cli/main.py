"""The `kiln` command line: worker, submit, status, wait, cancel, api, keys, demo.

User mistakes print one clear line and exit 2; a job that ends badly exits 1; no tracebacks.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.storage.errors import JobNotFound, StorageError
from kiln.tasks.cli import admin as admin_cli
from kiln.tasks.cli import batch as batch_cli
from kiln.tasks.cli import commands as c
from kiln.tasks.cli.embedded import DemoFailed
from kiln.tasks.cli.exits import (
    EXIT_JOB_FAILED,
    EXIT_NOT_SERVED,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    UsageError,
)
from kiln.tasks.cli.progress import JobWaitTimeout
from kiln.tasks.contract.schemas import Lane

__all__ = ["EXIT_JOB_FAILED", "EXIT_NOT_SERVED", "EXIT_USAGE", "EXIT_WAIT_TIMEOUT", "main"]


def _job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--api", metavar="URL", help="use a remote Kiln API instead of Redis")
    parser.add_argument("--api-key", metavar="KEY", help="bearer key for --api")


def _add_submit(sub: Any) -> None:
    # No defaults here: an option left out is left out of the request, and JobRequest fills it.
    p = sub.add_parser("submit", help="enqueue a job (prints its id, or waits with --wait)")
    p.add_argument("prompt")
    p.add_argument("--pipeline")
    p.add_argument("--negative-prompt")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--frames", dest="num_frames", type=int)
    p.add_argument("--fps", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--guidance", dest="guidance_scale", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--outputs", dest="num_outputs", type=int)
    p.add_argument("--format", dest="output_format")
    p.add_argument("--priority", choices=list(Lane))
    p.add_argument("--max-run-seconds", type=float)
    p.add_argument(
        "--input",
        dest="inputs",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a pipeline input (repeatable), e.g. scheduler=DDIMScheduler or strength=0.6; "
        "VALUE is read as JSON when it parses, else as text (GET /v1/pipelines/NAME lists a "
        "pipeline's inputs); image=@PATH uploads the file, image=https://... passes a URL",
    )
    p.add_argument(
        "--lora",
        dest="loras",
        action="append",
        default=[],
        metavar="NAME[:SCALE]",
        help="a LoRA adapter to apply (repeatable), at SCALE (default 1); GET "
        "/v1/pipelines/NAME lists a pipeline's adapters",
    )
    p.add_argument("--idempotency-key")
    p.add_argument("--wait", action="store_true", help="show progress and wait for the outputs")
    p.add_argument("--timeout", type=float, help="seconds to wait with --wait")
    _wait_for_node_arg(p)
    _job_args(p)


def _wait_for_node_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait-for-node",
        action="store_true",
        help="keep waiting while no live node serves the job's pipeline (default: exit 4)",
    )


def _add_worker(sub: Any) -> None:
    w = sub.add_parser("worker", help="run a node worker (or a webhooks worker)")
    w.add_argument("--pipeline", action="append", default=[], help="NAME or NAME=SPEC; repeatable")
    w.add_argument("--devices", default="cpu:1", help="cpu:N or cuda:0,cuda:1")
    w.add_argument("--queues", default=",".join(Lane), help="lanes, in priority order")
    w.add_argument("--max-batch", type=int, default=4)
    w.add_argument(
        "--batch-window-ms",
        type=float,
        default=0.0,
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
    w.add_argument("--concurrency", type=int)
    w.add_argument("--webhooks", action="store_true", help="also deliver webhooks")
    w.add_argument("--node-id")
    w.add_argument("--loglevel", default="INFO")


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


def _add_job_commands(sub: Any) -> None:
    for name, text in (("status", "show a job"), ("cancel", "cancel a job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("job_id")
        _job_args(p)
    p = sub.add_parser("wait", help="wait for jobs to finish, with progress")
    p.add_argument("job_ids", nargs="+")
    p.add_argument("--timeout", type=float, help="seconds to wait; exit 3 when they run out")
    _wait_for_node_arg(p)
    _job_args(p)


def _add_services(sub: Any) -> None:
    a = sub.add_parser("api", help="serve the HTTP API")
    a.add_argument("--host", help="listen address (default: KILN_API_HOST, else 127.0.0.1)")
    a.add_argument("--port", type=int, help="listen port (default: KILN_API_PORT, else 8000)")
    a.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="API processes on the one port (default: KILN_API_WORKERS, else 1)",
    )
    # internal: a child of `kiln api --workers N` serves on this inherited listening socket
    a.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    k = sub.add_parser("keys", help="manage API keys")
    k.add_argument("action", choices=["create", "list", "revoke"])
    k.add_argument("name_or_id", nargs="?")
    k.add_argument("--admin", action="store_true")
    k.add_argument(
        "--max-queued", type=int, metavar="N", help="create: most queued jobs of this key"
    )
    k.add_argument(
        "--max-running", type=int, metavar="N", help="create: most running jobs of this key"
    )
    k.add_argument("--json", action="store_true")
    d = sub.add_parser("demo", help="run the embedded demo")
    d.add_argument("--jobs", type=int, default=4, help="image jobs to submit (plus 2 videos)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: a job queue for GPU generation."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker(sub)
    _add_submit(sub)
    _add_job_commands(sub)
    _add_services(sub)
    admin_cli.add_parser(sub)
    batch_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kiln` console script."""
    args = build_parser().parse_args(argv)
    handler = _handlers()[args.command]
    try:
        return handler(args)
    except UsageError as exc:
        print(f"kiln: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValidationError as exc:
        print(f"kiln: {_validation_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a known failure of a dependency is still one line, not a trace
        known = _known_error(exc)
        if known is None:
            raise
        line, code = known
        print(f"kiln: {line}", file=sys.stderr)
        return code


def _validation_line(exc: ValidationError) -> str:
    # Settings classes are named *Settings and read KILN_* variables: name the variable.
    if exc.title.endswith("Settings"):
        return "; ".join(
            f"invalid setting {_env_name(err['loc'])}: {err['msg']}" for err in exc.errors()
        )
    return "invalid job: " + "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}" for err in exc.errors()
    )


def _env_name(loc: tuple[int | str, ...]) -> str:
    return "KILN_" + str(loc[0]).upper() if loc else "KILN_*"


def _known_error(exc: Exception) -> tuple[str, int] | None:
    # Deferred: the submitter loads Celery and Redis, the client httpx; `kiln --help` needs none.
    from kiln.tasks.client.client import KilnError
    from kiln.tasks.queue.submit import UnknownPipeline

    if isinstance(exc, JobNotFound):
        return f"no such job: {exc}", EXIT_JOB_FAILED
    if isinstance(exc, JobWaitTimeout):
        return str(exc), EXIT_WAIT_TIMEOUT
    if isinstance(exc, StorageError | UnknownPipeline | DemoFailed):
        return str(exc), EXIT_JOB_FAILED
    if isinstance(exc, KilnError):  # the API refused or failed the request
        return str(exc), EXIT_JOB_FAILED
    return None


def _handlers() -> dict[str, Callable[[argparse.Namespace], int]]:
    return {
        "worker": c.cmd_worker,
        "submit": c.cmd_submit,
        "status": c.cmd_status,
        "wait": c.cmd_wait,
        "cancel": c.cmd_cancel,
        "api": c.cmd_api,
        "keys": c.cmd_keys,
        "admin": admin_cli.run,
        "batch": batch_cli.run,
        "demo": c.cmd_demo,
    }


if __name__ == "__main__":
    sys.exit(main())
