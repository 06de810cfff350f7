"""The `kiln` command line: worker, submit, status, wait, cancel, api, keys, demo.

User mistakes print one clear line and exit 2; a job that ends badly exits 1; no tracebacks.
Every option's help shows its default; a mistake in a subcommand's arguments prints that
subcommand's usage. Job and batch ids may be given as any unique prefix (`cli.short_ids`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln.common.defaults import BATCH_WINDOW_S, MAX_BATCH
from kiln.common.request import Lane
from kiln.storage.errors import JobNotFound, StorageError
from kiln.tasks.cli import admin as admin_cli
from kiln.tasks.cli import batch as batch_cli
from kiln.tasks.cli import commands as c
from kiln.tasks.cli import config as config_cli
from kiln.tasks.cli import pipeline as pipeline_cli
from kiln.tasks.cli.backends import remote_args
from kiln.tasks.cli.embedded import DemoFailed
from kiln.tasks.cli.exits import (
    EXIT_ALREADY_FINISHED,
    EXIT_JOB_FAILED,
    EXIT_NOT_SERVED,
    EXIT_PIPE_CLOSED,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    UsageError,
)
from kiln.tasks.cli.progress import JobWaitTimeout
from kiln.tasks.cli.short_ids import JOB_ID_HELP
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings

__all__ = [
    "EXIT_ALREADY_FINISHED",
    "EXIT_JOB_FAILED",
    "EXIT_NOT_SERVED",
    "EXIT_PIPE_CLOSED",
    "EXIT_USAGE",
    "EXIT_WAIT_TIMEOUT",
    "main",
]


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends with each option's default, unless the text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or default == []:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


class KilnParser(argparse.ArgumentParser):
    """The parser of `kiln` and of each subcommand: defaults shown, mistakes told where made."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse; a command without subcommands refuses what it does not know, with its usage.

        (argparse hands unknown arguments up to `kiln` itself, which printed its own usage.)
        """
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self._subparsers is None:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        return parsed, extras

    def _suggestion(self, extras: list[str]) -> str:
        known = [o for action in self._actions for o in action.option_strings]
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=")[0], known, n=1)
            if extra.startswith("--") and close:
                return f" (did you mean {close[0]}?)"
        return ""


def _version() -> str:
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


def _job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote_args(parser)


def _request_default(field: str) -> str:
    """`(default: X)` of a job request field: what JobRequest fills in when it is left out."""
    default = JobRequest.model_fields[field].default
    return "(default: drawn at submit)" if default is None else f"(default: {default})"


def _add_submit(sub: Any) -> None:
    # No defaults here: an option left out is left out of the request, and JobRequest fills it.
    p = sub.add_parser("submit", help="enqueue a job (prints its id, or waits with --wait)")
    p.add_argument("prompt", help="what to generate")
    p.add_argument("--pipeline", help=f"a served pipeline {_request_default('pipeline')}")
    p.add_argument("--negative-prompt", help="what to steer away from (default: none)")
    p.add_argument("--width", type=int, help=f"pixels {_request_default('width')}")
    p.add_argument("--height", type=int, help=f"pixels {_request_default('height')}")
    p.add_argument(
        "--frames",
        dest="num_frames",
        type=int,
        help=f"1 for an image, more for a video {_request_default('num_frames')}",
    )
    p.add_argument(
        "--fps", type=int, help=f"frames per second of a video {_request_default('fps')}"
    )
    p.add_argument("--steps", type=int, help=f"denoising steps {_request_default('steps')}")
    p.add_argument(
        "--guidance",
        dest="guidance_scale",
        type=float,
        help=f"guidance scale {_request_default('guidance_scale')}",
    )
    p.add_argument("--seed", type=int, help=f"random seed {_request_default('seed')}")
    p.add_argument(
        "--outputs",
        dest="num_outputs",
        type=int,
        help=f"outputs of the one job {_request_default('num_outputs')}",
    )
    p.add_argument(
        "--format",
        dest="output_format",
        help="png, jpeg or webp for images; mp4, webm or gif for videos (default: png or mp4)",
    )
    p.add_argument(
        "--priority",
        choices=list(Lane),
        help=f"the lane it queues in {_request_default('priority')}",
    )
    p.add_argument(
        "--max-run-seconds", type=float, help="deadline of one run, in seconds (default: none)"
    )
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
    p.add_argument(
        "--idempotency-key",
        help="submitting again with the same key gives back the same job (default: none)",
    )
    p.add_argument("--wait", action="store_true", help="show progress and wait for the outputs")
    p.add_argument(
        "--timeout", type=float, help="seconds to wait with --wait, then exit 3 (default: none)"
    )
    p.add_argument(
        "--preview",
        type=Path,
        metavar="DIR",
        help="ask for previews while denoising and keep the newest in DIR/<job_id>.<format> "
        "(implies --wait; default: no previews)",
    )
    p.add_argument(
        "--preview-every", type=int, metavar="N", help="a preview every N steps (default: 1)"
    )
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


def _add_job_commands(sub: Any) -> None:
    for name, text in (
        ("status", "show a job"),
        ("cancel", f"cancel a job (a finished one: exit {EXIT_ALREADY_FINISHED})"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("job_id", metavar="JOB", help=JOB_ID_HELP)
        _job_args(p)
    p = sub.add_parser("wait", help="wait for jobs to finish, with progress")
    p.add_argument("job_ids", metavar="JOB", nargs="+", help=JOB_ID_HELP)
    p.add_argument(
        "--timeout", type=float, help="seconds to wait; exit 3 when they run out (default: none)"
    )
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
    k.add_argument("action", choices=["create", "list", "revoke"], help="what to do")
    k.add_argument("name_or_id", nargs="?", help="create: the key's name; revoke: its id")
    k.add_argument("--admin", action="store_true", help="create: a key for admin routes")
    k.add_argument(
        "--max-queued",
        type=int,
        metavar="N",
        help="create: most queued jobs of this key (default: KILN_MAX_QUEUED_PER_KEY)",
    )
    k.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help="create: most running jobs of this key (default: KILN_MAX_RUNNING_PER_KEY)",
    )
    k.add_argument("--json", action="store_true", help="print JSON instead of text")
    d = sub.add_parser("demo", help="run the embedded demo")
    d.add_argument("--jobs", type=int, default=4, help="image jobs to submit (plus 2 videos)")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = KilnParser(prog="kiln", description="Kiln: a job queue for GPU generation.")
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_worker(sub)
    _add_submit(sub)
    _add_job_commands(sub)
    _add_services(sub)
    admin_cli.add_parser(sub)
    batch_cli.add_parser(sub)
    pipeline_cli.add_parser(sub)
    config_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kiln` console script."""
    args = build_parser().parse_args(argv)
    handler = _handlers()[args.command]
    try:
        config_cli.check_environment()  # every command: an unknown KILN_* variable stops it
        _remote_defaults(args)
        code = handler(args)
        sys.stdout.flush()  # a closed pipe fails here, where it is caught, not at exit
        return code
    except BrokenPipeError:  # the reader went away (`| head`): end quietly, as Unix tools do
        _silence_stdout()
        return EXIT_PIPE_CLOSED
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


def _remote_defaults(args: argparse.Namespace) -> None:
    """A remote command's `--api`/`--api-key` left out: KILN_API_URL/KILN_API_KEY, if set."""
    if not hasattr(args, "api"):
        return
    settings = KilnSettings()
    if args.api is None:
        args.api = settings.api_url
    if args.api_key is None and settings.api_key is not None:
        args.api_key = settings.api_key.get_secret_value()


def _silence_stdout() -> None:
    # What is still buffered for stdout would fail again when Python flushes it at exit.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (captured): nothing is flushed to a pipe
        pass


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
        "pipeline": pipeline_cli.run,
        "demo": c.cmd_demo,
        "config": config_cli.run,
    }


if __name__ == "__main__":
    sys.exit(main())
