"""The bodies of the `kiln` subcommands (argument parsing lives in `cli.main`).

Each heavy service is imported in the command that runs it, so that `kiln --help` or `kiln submit
--api` never loads torch (the node), uvicorn (the API) or Redis and Celery (direct submission).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from kiln.common.states import JobState
from kiln.tasks.cli.backends import DirectBackend, HttpBackend, JobsBackend
from kiln.tasks.cli.bounds import with_pipeline_bounds
from kiln.tasks.cli.consoles import stdout_console
from kiln.tasks.cli.exits import (
    EXIT_ALREADY_FINISHED,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NOT_SERVED,
    UsageError,
    print_json,
    say_stopped_waiting,
)
from kiln.tasks.cli.input_files import upload_file
from kiln.tasks.cli.progress import JobWaitTimeout, wait_for_jobs
from kiln.tasks.cli.tables import metric_text
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView

SUBMIT_FIELDS = (
    "pipeline",
    "prompt",
    "negative_prompt",
    "width",
    "height",
    "num_frames",
    "fps",
    "steps",
    "guidance_scale",
    "seed",
    "num_outputs",
    "output_format",
    "priority",
    "max_run_seconds",
    "speed",
)


def checkpoint_cadence(text: str) -> dict[str, Any]:
    """`--checkpoint-every`: `10` is every 10 steps, `90s` every 90 seconds.

    Only the form is checked here; the request's own checks say what is out of range.
    """
    value = text.strip()
    try:
        if value.endswith("s"):
            return {"every_seconds": float(value[:-1])}
        return {"every_steps": int(value)}
    except ValueError:
        raise UsageError(
            f"--checkpoint-every {text}: give steps (10) or seconds ending in s (90s)"
        ) from None


def backend_for(args: argparse.Namespace) -> JobsBackend:
    """The remote API when `--api` is given, else Redis directly."""
    if getattr(args, "api", None):
        return HttpBackend(args.api, args.api_key)
    return DirectBackend()


def cmd_submit(args: argparse.Namespace) -> int:
    """`kiln submit`."""
    fields: dict[str, Any] = {
        name: getattr(args, name) for name in SUBMIT_FIELDS if getattr(args, name) is not None
    }
    if args.inputs:
        fields["inputs"] = parse_inputs(args.inputs, upload=lambda path: upload_file(args, path))
    if args.loras:
        fields["loras"] = parse_loras(args.loras)
    if args.preview is not None or args.preview_every is not None:
        every = args.preview_every
        fields["preview"] = {"every_steps": every} if every is not None else {}
    if args.checkpoint_every is not None:
        fields["checkpoint"] = checkpoint_cadence(args.checkpoint_every)
    with contextlib.closing(backend_for(args)) as backend:
        return _submit_command(args, backend, fields)


def _submit_command(args: argparse.Namespace, backend: JobsBackend, fields: dict[str, Any]) -> int:
    """`kiln submit` on `backend`: submit, then wait and follow previews as asked."""
    try:
        request = JobRequest.model_validate(fields)
    except ValidationError as error:  # a bound the pipeline declares lower is named as its own
        raise with_pipeline_bounds(error, fields, backend) from None
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        view = _submit(args, backend, request, deadline)
    except NodeWaitInterrupted:
        print("kiln: stopped waiting for a node; nothing was submitted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.preview is None and not args.wait:
        _show(args, [view], ids_only=True)
        return 0
    followers = []
    if args.preview is not None:
        from kiln.tasks.cli.previews import follow_previews

        followers = follow_previews(backend, [view.id], args.preview)
    status = _wait_and_show(args, backend, [view.id], deadline)
    for follower in followers:
        follower.join(timeout=5)  # its stream ends at the terminal event: the newest is written
    return status


NODE_POLL_S = 0.5  # how often `--wait-for-node` asks whether the pipeline is served yet


class NodeWaitInterrupted(Exception):
    """Ctrl-C while `--wait-for-node` waited for the pipeline: nothing was submitted."""


def _submit(
    args: argparse.Namespace, backend: JobsBackend, request: JobRequest, deadline: float | None
) -> JobView:
    """Submit; with `--wait-for-node`, a pipeline nobody serves yet is waited for, not refused.

    The wait ends when a node announces the pipeline (then the job is submitted), or at
    `deadline` (`--timeout`: JobWaitTimeout, exit 3).
    """
    from kiln.common.tracing import given_carrier  # deferred: `kiln --help` loads no tracing

    told = False
    while True:
        try:
            return backend.submit(
                request,
                idempotency_key=args.idempotency_key,
                trace=given_carrier(args.traceparent, args.tracestate),
            )
        except Exception as exc:
            if not (args.wait_for_node and _unknown_pipeline(exc)):
                raise
        try:
            if not told:
                print(
                    f"kiln: no node serves pipeline {request.pipeline!r} yet; waiting for one "
                    "(--wait-for-node)",
                    file=sys.stderr,
                    flush=True,
                )
                told = True
            _wait_for_pipeline(args, backend, request.pipeline, deadline)
        except KeyboardInterrupt:
            raise NodeWaitInterrupted from None


def _wait_for_pipeline(
    args: argparse.Namespace, backend: JobsBackend, pipeline: str, deadline: float | None
) -> None:
    """Return once `pipeline` is one jobs may name; JobWaitTimeout at `deadline`."""
    while pipeline not in backend.pipelines():
        if deadline is not None and time.monotonic() >= deadline:
            raise JobWaitTimeout(
                f"no node announced pipeline {pipeline!r} within {args.timeout:g} s; "
                "nothing was submitted"
            )
        time.sleep(NODE_POLL_S if deadline is None else _left(deadline, NODE_POLL_S))


def _left(deadline: float, most: float) -> float:
    return max(0.0, min(most, deadline - time.monotonic()))


def _unknown_pipeline(exc: Exception) -> bool:
    """Whether a refused submit names a pipeline nobody serves (directly, or through the API)."""
    from kiln.tasks.client.client import ValidationFailed
    from kiln.tasks.contract.request_check import PipelineUnknown
    from kiln.tasks.intake.refusal import Refused

    if isinstance(exc, Refused):
        return exc.refusal.code == PipelineUnknown.kind
    if isinstance(exc, ValidationFailed) and isinstance(exc.detail, list):
        kinds = {e.get("type") for e in exc.detail if isinstance(e, dict)}
        return PipelineUnknown.kind in kinds
    return False


def parse_loras(values: list[str]) -> list[dict[str, Any]]:
    """`--lora NAME[:SCALE]` options as a request's `loras` (the contract checks the rest)."""
    loras: list[dict[str, Any]] = []
    for value in values:
        name, sep, scale = value.partition(":")
        lora: dict[str, Any] = {"name": name.strip()}
        if sep:
            try:
                lora["scale"] = float(scale)
            except ValueError:
                raise UsageError(f"--lora {value}: SCALE must be a number") from None
        loras.append(lora)
    return loras


def parse_inputs(values: list[str], upload: Callable[[str], str] | None = None) -> dict[str, Any]:
    """`--input NAME=VALUE` options as a request's `inputs`: VALUE as JSON when it parses.

    `NAME=@PATH` uploads the file with `upload`, which returns the reference to pass.
    """
    inputs: dict[str, Any] = {}
    for value in values:
        name, sep, text = value.partition("=")
        name = name.strip()
        if not sep or not name:
            raise UsageError(f"--input {value!r}: expected NAME=VALUE")
        if name in inputs:
            raise UsageError(f"--input {name}: given twice")
        if text.startswith("@"):
            if upload is None:
                raise UsageError(f"--input {name}={text}: files (@PATH) cannot be uploaded here")
            inputs[name] = upload(text[1:])
            continue
        try:
            inputs[name] = json.loads(text)
        except ValueError:
            inputs[name] = text  # not JSON: the text itself (scheduler=DDIMScheduler)
    return inputs


def cmd_status(args: argparse.Namespace) -> int:
    """`kiln status JOB`."""
    with contextlib.closing(backend_for(args)) as backend:
        _show(args, [backend.get(backend.resolve(args.job_id))])
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    """`kiln wait JOB...`."""
    with contextlib.closing(backend_for(args)) as backend:
        return _wait_and_show(args, backend, [backend.resolve(job_id) for job_id in args.job_ids])


def cmd_cancel(args: argparse.Namespace) -> int:
    """`kiln cancel JOB`: exit 5 (nothing canceled) when the job had already finished."""
    with contextlib.closing(backend_for(args)) as backend:
        result = backend.cancel(backend.resolve(args.job_id))
    _show(args, [result.job])
    view = result.job
    if result.effect == "already_finished":
        print(f"kiln: job {view.id} had already finished ({view.status})", file=sys.stderr)
        return EXIT_ALREADY_FINISHED
    if result.effect == "cancel_requested":
        print(f"kiln: job {view.id} is running: it stops at its next step", file=sys.stderr)
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    """`kiln pause JOB`: a queued job pauses now, a running one at its next step (a checkpoint)."""
    with contextlib.closing(backend_for(args)) as backend:
        result = backend.pause(backend.resolve(args.job_id))
    _show(args, [result.job])
    if result.effect == "pause_requested":
        print(f"kiln: job {result.job.id} is running: it pauses at its next step", file=sys.stderr)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    """`kiln resume JOB`: a paused job is queued again (its next run starts at its checkpoint)."""
    with contextlib.closing(backend_for(args)) as backend:
        result = backend.resume(backend.resolve(args.job_id))
    _show(args, [result.job])
    if result.effect == "not_paused":
        print(f"kiln: job {result.job.id} was not paused ({result.job.status})", file=sys.stderr)
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    """`kiln jobs [--status S] [--pipeline P] [--batch B] [--since WHEN] [--limit N]`."""
    from kiln.tasks.cli.batch_backends import backend_for as batches_for
    from kiln.tasks.cli.jobs import cmd_jobs as list_command

    if args.batch is not None:  # any unique prefix, as every command takes a batch id
        with contextlib.closing(batches_for(args.api, args.api_key)) as batches:
            args.batch = batches.resolve(args.batch)
    with contextlib.closing(backend_for(args)) as backend:
        return list_command(args, backend)


def cmd_get(args: argparse.Namespace) -> int:
    """`kiln get JOB [DIR]`."""
    from kiln.tasks.cli.jobs import cmd_get as get_command

    with contextlib.closing(backend_for(args)) as backend:
        return get_command(args, backend)


def cmd_api(args: argparse.Namespace) -> int:
    """`kiln api`: one API process, or with `--workers N` (N > 1) a supervisor of N."""
    # Deferred: the API loads FastAPI, uvicorn, Celery and Redis.
    from kiln.storage.base import require_supported_redis
    from kiln.tasks.api.app import serve_api
    from kiln.tasks.queue.process import start_process

    parts = start_process()
    settings, storage_settings = parts.settings, parts.storage_settings
    require_supported_redis(storage_settings)  # one line, before anything starts
    if args.fd is not None:  # a child of the supervisor below
        serve_api(settings, storage_settings, fd=args.fd)
        return 0
    host = args.host if args.host is not None else settings.api_host
    port = args.port if args.port is not None else settings.api_port
    workers = args.workers if args.workers is not None else settings.api_workers
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if workers == 1:
        serve_api(settings, storage_settings, host, port)
        return 0
    from kiln.common.logs import configure_logging
    from kiln.tasks.api.context import check_connection_budget
    from kiln.tasks.api.supervisor import serve_workers

    check_connection_budget(settings, storage_settings)  # per process; refused before any child
    # Plain JSON lines, no stdio capture: each child captures its own output.
    configure_logging(settings.log_format, "INFO")
    return serve_workers(host, port, workers)


def cmd_keys(args: argparse.Namespace) -> int:
    """`kiln keys create NAME | list | revoke ID`."""
    # Deferred: the key store loads Redis.
    from kiln.tasks.cli import keys as keys_cli

    return keys_cli.run(
        args.action,
        args.name_or_id,
        admin=args.admin,
        as_json=args.json,
        max_queued=args.max_queued,
        max_running=args.max_running,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """`kiln demo`."""
    # Deferred: the demo drives the API through httpx and may start an embedded Redis.
    from kiln.tasks.cli.demo import run_demo

    return run_demo(image_jobs=args.jobs)


def _wait_and_show(
    args: argparse.Namespace,
    backend: JobsBackend,
    job_ids: list[str],
    deadline: float | None = None,
) -> int:
    """Wait for the jobs with progress, then show them; Ctrl-C says how to follow them (130)."""
    try:
        return _wait_then_show(args, backend, job_ids, deadline)
    except KeyboardInterrupt:
        _stopped_waiting(args, job_ids)
        return EXIT_INTERRUPTED


def _stopped_waiting(args: argparse.Namespace, job_ids: list[str]) -> None:
    """What a Ctrl-C leaves: the jobs go on; the command that follows them (on stderr)."""
    ids = " ".join(job_ids)
    jobs = f"job {ids} goes on" if len(job_ids) == 1 else f"jobs {ids} go on"
    say_stopped_waiting(args, jobs, f"kiln wait {ids}")


def _wait_then_show(
    args: argparse.Namespace, backend: JobsBackend, job_ids: list[str], deadline: float | None
) -> int:
    if not args.wait_for_node:
        unserved = [view for view in map(backend.get, job_ids) if view.waiting_for]
        if unserved:
            for view in unserved:
                print(f"kiln: job {view.id}: {view.waiting_for}", file=sys.stderr)
            print("kiln: not waiting; pass --wait-for-node to wait anyway", file=sys.stderr)
            return EXIT_NOT_SERVED
    show_bars = not args.json and sys.stderr.isatty()
    timeout_s = args.timeout if deadline is None else max(0.0, deadline - time.monotonic())
    views = wait_for_jobs(
        backend, job_ids, timeout_s=timeout_s, show=show_bars, console=Console(stderr=True)
    )
    _show(args, views)
    return 0 if all(v.status == JobState.SUCCEEDED for v in views) else EXIT_JOB_FAILED


def _show(args: argparse.Namespace, views: list[JobView], ids_only: bool = False) -> None:
    if args.json:
        data: Any = [v.model_dump(mode="json") for v in views]
        print_json(data[0] if len(data) == 1 else data)
        return
    if ids_only:
        for view in views:
            print(view.id)
        return
    console = stdout_console()
    for view in views:
        console.print(job_table(view))
        # whole, on lines of their own: a path cut or folded to the terminal's width is useless
        for index, output in enumerate(view.outputs):
            console.print(f"output {index}: {output.url}", soft_wrap=True, highlight=False)


def job_table(view: JobView) -> Table:
    """A human view of one job (its outputs' URLs are printed whole below it, not in it)."""
    title = f"job {view.id}"
    table = Table(title=title, show_header=False, min_width=len(title))  # the id never wraps
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # wrapped when narrow, never cut short
    table.add_row("status", view.status)
    if view.waiting_for:
        table.add_row("waiting for", view.waiting_for)
    if view.progress:
        table.add_row("progress", view.progress.describe())
    if view.queue_position is not None:
        table.add_row("queue position", f"{view.queue_position} (jobs to start before it)")
    if view.estimated_start_s is not None:
        table.add_row("estimated start", f"in {view.estimated_start_s:g} s")
    table.add_row("attempts", str(view.attempts))
    if view.error:
        table.add_row("error", f"{view.error.type}: {view.error.message}")
    for metric, value in view.metrics.model_dump(exclude_none=True).items():
        table.add_row(metric, metric_text(metric, value))
    table.add_row("outputs", str(len(view.outputs)))
    return table
