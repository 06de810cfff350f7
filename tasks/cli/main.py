"""The `kiln` command line: worker, control, submit, status, wait, cancel, pause, jobs, get, api...

User mistakes print one clear line and exit 2; a job that ends badly exits 1; no tracebacks.
Every option's help shows its default; a mistake in a subcommand's arguments prints that
subcommand's usage. Job and batch ids may be given as any unique prefix (`cli.short_ids`).

What a command does not use is not imported: this module loads the standard library and
`cli.worker` only, and each command builds its own parser alone (`COMMANDS`). `kiln worker`
checks its pipelines before the settings check and anything heavy (`cli.worker`); the other
commands load what they use (the contract's models, the client, Redis) once they are known.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kiln.common.distribution import DISTRIBUTION
from kiln.common.request import SPEED_MODES, Lane
from kiln.tasks.cli import worker as worker_cli
from kiln.tasks.cli.exits import (
    EXIT_ALREADY_FINISHED,
    EXIT_JOB_FAILED,
    EXIT_NOT_SERVED,
    EXIT_PIPE_CLOSED,
    EXIT_USAGE,
    EXIT_WAIT_TIMEOUT,
    UsageError,
)

if TYPE_CHECKING:
    from pydantic import ValidationError

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
    import importlib.metadata  # slow to load: only for `--version`

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


class _VersionShown(argparse._VersionAction):
    """`--version`: the installed distribution's version, read only when asked for."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        self.version = f"kiln {_version()}"
        super().__call__(parser, namespace, values, option_string)


def _job_args(parser: argparse.ArgumentParser) -> None:
    from kiln.tasks.cli.backends import remote_args

    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote_args(parser)


def _request_default(field: str) -> str:
    """`(default: X)` of a job request field: what JobRequest fills in when it is left out."""
    from kiln.tasks.contract.schemas import JobRequest

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
        "--speed",
        choices=SPEED_MODES,
        help="exact runs the model as it is; balanced and fast skip denoiser blocks whose output "
        "barely changes between steps (faster, slightly different pixels); a pipeline that "
        f"serves exact only refuses the others {_request_default('speed')}",
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
    p.add_argument(
        "--traceparent",
        default=os.environ.get("TRACEPARENT"),
        help="the W3C trace context the job's trace continues (default: $TRACEPARENT, else a "
        "trace of its own where tracing is on)",
    )
    p.add_argument(
        "--tracestate",
        default=os.environ.get("TRACESTATE"),
        help="the W3C tracestate sent with --traceparent (default: $TRACESTATE)",
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
    p.add_argument(
        "--checkpoint-every",
        metavar="N|Ss",
        help="a step checkpoint every N steps, or every S seconds (e.g. 10, or 90s), so an "
        "interrupted job resumes there (default: the node's: a video every 30 s, an image never)",
    )
    _wait_for_node_arg(p)
    _job_args(p)


def _wait_for_node_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait-for-node",
        action="store_true",
        help="keep waiting while no live node serves the job's pipeline (default: exit 4)",
    )


def _add_job_commands(sub: Any) -> None:
    from kiln.tasks.cli.short_ids import JOB_ID_HELP

    for name, text in (
        ("status", "show a job"),
        ("cancel", f"cancel a job (a finished one: exit {EXIT_ALREADY_FINISHED})"),
        ("pause", "pause a job: no GPU, its checkpoint kept (a running one at its next step)"),
        ("resume", "queue a paused job again, at the back of its lane"),
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
    from kiln.tasks.cli import jobs as jobs_cli

    jobs_cli.add_parsers(sub, _job_args)


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


@dataclass(frozen=True)
class Command:
    """A `kiln` command: the module (under kiln.tasks.cli) and function that run it, its parser.

    `adds_parser` adds its parser (with a few related commands'), else its module's `add_parser`.
    """

    module: str
    handler: str = "run"
    adds_parser: Callable[[Any], None] | None = None

    def add_parser(self, sub: Any) -> None:
        """Add this command's parser to `sub`, importing only what that takes."""
        if self.adds_parser is not None:
            self.adds_parser(sub)
        else:
            self._module().add_parser(sub)

    def run(self) -> Callable[[argparse.Namespace], int]:
        """The function that runs this command, its module imported now."""
        handler: Callable[[argparse.Namespace], int] = getattr(self._module(), self.handler)
        return handler

    def _module(self) -> ModuleType:
        return _command_module(self.module)


def _command_module(name: str) -> ModuleType:
    """A command's module, imported now: a static import each, so the import contracts see it."""
    match name:
        case "commands":
            from kiln.tasks.cli import commands

            return commands
        case "worker":
            return worker_cli
        case "admin":
            from kiln.tasks.cli import admin

            return admin
        case "batch":
            from kiln.tasks.cli import batch

            return batch
        case "pipeline":
            from kiln.tasks.cli import pipeline

            return pipeline
        case "config":
            from kiln.tasks.cli import config

            return config
        case "control":
            from kiln.tasks.cli import control

            return control
        case "dead":
            from kiln.tasks.cli import dead

            return dead
        case "usage":
            from kiln.tasks.cli import usage

            return usage
    raise KeyError(f"no command module {name!r}")


def _job_command(handler: str) -> Command:
    return Command("commands", handler, _add_job_commands)


def _service(handler: str) -> Command:
    return Command("commands", handler, _add_services)


# Every command. A command's parser is built alone, so `kiln status` imports neither the batch,
# admin nor usage commands' modules (and `kiln worker` refuses its arguments before the
# contract's models or Redis load); `kiln`, `--help` and an unknown name get every parser, in
# this order.
COMMANDS: dict[str, Command] = {
    "worker": Command("worker", adds_parser=worker_cli.add_parser),
    "submit": Command("commands", "cmd_submit", _add_submit),
    **{name: _job_command(f"cmd_{name}") for name in ("status", "cancel", "pause", "resume")},
    **{name: _job_command(f"cmd_{name}") for name in ("wait", "jobs", "get")},
    **{name: _service(f"cmd_{name}") for name in ("api", "keys", "demo")},
    **{name: Command(name) for name in ("admin", "batch", "pipeline", "config")},
    **{name: Command(name) for name in ("control", "dead", "usage")},
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line of `command` alone when it is one (`COMMANDS`), else the whole."""
    parser = KilnParser(prog="kiln", description="Kiln: a job queue for GPU generation.")
    parser.add_argument("--version", action=_VersionShown, help="print Kiln's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    alone = COMMANDS.get(command or "")
    # a parser that adds several commands is added once
    parsers = {c.adds_parser or c.module: c for c in COMMANDS.values()}.values()
    for entry in [alone] if alone else parsers:
        entry.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kiln` console script."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(arguments[0] if arguments else None).parse_args(arguments)
    try:
        if args.command == "worker":  # its refusals before anything heavy loads (`cli.worker`)
            worker_cli.check_arguments(args)
        from kiln.tasks.cli.config import check_environment

        check_environment()  # every command: an unknown KILN_* variable stops it
        _remote_defaults(args)
        code = _handler(args.command)(args)
        sys.stdout.flush()  # a closed pipe fails here, where it is caught, not at exit
        return code
    except BrokenPipeError:  # the reader went away (`| head`): end quietly, as Unix tools do
        _silence_stdout()
        return EXIT_PIPE_CLOSED
    except UsageError as exc:
        print(f"kiln: {exc}", file=sys.stderr)
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
    from kiln.tasks.contract.settings import KilnSettings

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
            f"invalid setting {_env_name(err['loc'])}: {err['msg'].removeprefix('Value error, ')}"
            for err in exc.errors()
            # a default computed from a field that failed is a consequence, not a second mistake
            if err["type"] != "default_factory_not_called"
        )
    return "invalid job: " + "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}" for err in exc.errors()
    )


def _env_name(loc: tuple[int | str, ...]) -> str:
    return "KILN_" + str(loc[0]).upper() if loc else "KILN_*"


def _known_error(exc: Exception) -> tuple[str, int] | None:
    # Each class is looked for only where its module is loaded: an exception of a class nobody
    # imported cannot have been raised, and importing the intake, Celery and httpx to learn that
    # made every failed command slower by half a CPU second.
    loaded = sys.modules
    if "pydantic" in loaded:
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            return _validation_line(exc), EXIT_USAGE
    if "kiln.tasks.intake.refusal" in loaded:
        from kiln.tasks.contract.request_check import PipelineUnknown
        from kiln.tasks.intake.refusal import Refused

        if isinstance(exc, Refused):  # the intake's: a field it names (usage), else the queue's
            if exc.refusal.status == 422 and exc.refusal.code != PipelineUnknown.kind:
                return f"invalid job: {exc}", EXIT_USAGE
            return str(exc), EXIT_JOB_FAILED
    for failure, prefix, code in _loaded_failures():
        if isinstance(exc, failure):
            return f"{prefix}{exc}", code
    return None


def _loaded_failures() -> Iterator[tuple[type[Exception], str, int]]:
    """The failures a command reports in one line (prefix, exit code), of the modules loaded."""
    loaded = sys.modules
    if "kiln.storage.errors" in loaded:
        from kiln.storage.errors import JobNotFound, StorageError

        yield JobNotFound, "no such job: ", EXIT_JOB_FAILED
        yield StorageError, "", EXIT_JOB_FAILED
    if "kiln.tasks.cli.progress" in loaded:
        from kiln.tasks.cli.progress import JobWaitTimeout

        yield JobWaitTimeout, "", EXIT_WAIT_TIMEOUT
    if "kiln.tasks.intake.pausing" in loaded:
        from kiln.tasks.intake.pausing import PauseRefused

        yield PauseRefused, "", EXIT_JOB_FAILED  # a finished job (`kiln pause|resume`)
    if "kiln.tasks.cli.embedded" in loaded:
        from kiln.tasks.cli.embedded import DemoFailed

        yield DemoFailed, "", EXIT_JOB_FAILED
    if "kiln.tasks.client.client" in loaded:
        from kiln.tasks.client.client import KilnError

        yield KilnError, "", EXIT_JOB_FAILED  # the API refused or failed the request


def _handler(command: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs `command`, its module imported now."""
    return COMMANDS[command].run()


if __name__ == "__main__":
    sys.exit(main())
