"""`kiln dead list|show|redrive`: the dead letters (failed jobs) and their redrive.

Without `--api` the commands read and write Redis directly, as `kiln admin` does (whoever reaches
Redis sees every owner's); with `--api URL --api-key KEY` they call /v1/dead-letters, scoped to
the key's own jobs unless it is an admin key. docs/operations.md §17 tells the whole story.
"""

from __future__ import annotations

import argparse
import datetime
from typing import Any

from kiln.tasks.cli.backends import remote_args
from kiln.tasks.cli.exits import UsageError, print_json
from kiln.tasks.contract.dead_letters import (
    DEFAULT_REDRIVE_RATE,
    MAX_REDRIVE,
    MAX_REDRIVE_RATE,
    DeadLetterList,
    DeadLetterView,
    RedriveFilter,
    RedriveRequest,
    RedriveResult,
)

ACTIONS = ("list", "show", "redrive")


def add_parser(sub: Any) -> None:
    """`kiln dead ...` and its actions."""
    dead = sub.add_parser("dead", help="dead letters: failed jobs, what they went through, redrive")
    actions = dead.add_subparsers(dest="dead_action", required=True)
    listed = actions.add_parser("list", help="failed jobs newest first: error, attempts, redrive")
    listed.add_argument("--owner", help="an API key id's only (admin keys with --api)")
    listed.add_argument("--limit", type=int, default=50, help="at most this many")
    listed.add_argument("--cursor", help="the next page (a list's next_cursor)")
    _common(listed)
    show = actions.add_parser("show", help="one failed job: request, every attempt, error")
    show.add_argument("job_id", metavar="JOB", help="the failed job's id")
    _common(show)
    redrive = actions.add_parser(
        "redrive", help="a new job for each dead letter named, or each one a filter takes"
    )
    redrive.add_argument("job_ids", metavar="JOB", nargs="*", help="dead letters by job id")
    redrive.add_argument("--error-type", help="filter: the final error's type, e.g. poison")
    redrive.add_argument(
        "--poison", action="store_true", default=None, help="filter: poison jobs only"
    )
    redrive.add_argument("--pipeline", help="filter: the pipeline the job named")
    redrive.add_argument("--since", type=float, help="filter: failed at or after (epoch s)")
    redrive.add_argument("--until", type=float, help="filter: failed before (epoch s)")
    redrive.add_argument("--owner", help="filter: an API key id's only")
    redrive.add_argument("--limit", type=int, default=100, help="filter: at most this many")
    redrive.add_argument(
        "--dry-run", action="store_true", help="list what would be redriven, change nothing"
    )
    redrive.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_REDRIVE_RATE,
        help=f"new jobs per second at most (up to {MAX_REDRIVE_RATE:g})",
    )
    _common(redrive)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote_args(parser)


def run(args: argparse.Namespace) -> int:
    """Run one `kiln dead` action; returns the exit code."""
    action = args.dead_action
    if action == "redrive":
        request = _redrive_request(args)
        result = _remote_redrive(args, request) if args.api else _direct_redrive(request)
        _print(args, result, _describe_redrive)
    elif action == "show":
        letter = _remote_show(args) if args.api else _direct_show(args.job_id)
        _print(args, letter, _describe_letter)
    else:
        if args.limit < 1:
            raise UsageError("--limit must be at least 1")
        page = _remote_list(args) if args.api else _direct_list(args)
        _print(args, page, _describe_page)
    return 0


def _print(args: argparse.Namespace, model: Any, describe: Any) -> None:
    if args.json:
        print_json(model.model_dump(mode="json"))
    else:
        print(describe(model))


def _redrive_request(args: argparse.Namespace) -> RedriveRequest:
    filtered = any(
        value is not None
        for value in (
            args.error_type,
            args.poison,
            args.pipeline,
            args.since,
            args.until,
            args.owner,
        )
    )
    if bool(args.job_ids) == filtered:
        raise UsageError("name dead letters by JOB id, or give a filter (--error-type ...): one")
    if not 0 < args.rate <= MAX_REDRIVE_RATE:
        raise UsageError(f"--rate must be above 0 and at most {MAX_REDRIVE_RATE:g}")
    if not 1 <= args.limit <= MAX_REDRIVE or len(args.job_ids) > MAX_REDRIVE:
        raise UsageError(f"at most {MAX_REDRIVE} dead letters per redrive")
    chosen = None
    if filtered:
        chosen = RedriveFilter(
            error_type=args.error_type,
            poison=args.poison,
            pipeline=args.pipeline,
            since=args.since,
            until=args.until,
            owner=args.owner,
        )
    return RedriveRequest(
        ids=args.job_ids or None,
        filter=chosen,
        limit=args.limit,
        dry_run=args.dry_run,
        rate=args.rate,
    )


# --- straight to Redis ---------------------------------------------------------------------------


def _direct_parts() -> tuple[Any, Any]:
    # Deferred: Redis and Celery load only for this command.
    from kiln.storage.dead_letters import DeadLetterStore
    from kiln.tasks.queue.process import ProcessParts

    parts = ProcessParts()  # the command's process: its environment, read once
    store = parts.store
    return parts, DeadLetterStore(store.redis, store.settings)


def _view(letter: Any) -> DeadLetterView:
    from kiln.tasks.intake.redrive import dead_letter_view

    return dead_letter_view(letter)


def _direct_list(args: argparse.Namespace) -> DeadLetterList:
    _, letters = _direct_parts()
    try:
        page, cursor = letters.page(args.owner, args.cursor, args.limit)
    except ValueError as exc:
        raise UsageError(f"--cursor: {exc}") from exc
    return DeadLetterList(dead_letters=[_view(letter) for letter in page], next_cursor=cursor)


def _direct_show(job_id: str) -> DeadLetterView:
    _, letters = _direct_parts()
    letter = letters.get(job_id)
    if letter is None:
        raise UsageError(f"no dead letter {job_id!r}")
    return _view(letter)


def _direct_redrive(request: RedriveRequest) -> RedriveResult:
    from kiln.tasks.intake.redrive import chosen_letters, redrive

    parts, letters = _direct_parts()
    store = parts.store
    owner = None if request.filter is None else request.filter.owner
    targets = chosen_letters(letters, request, owner)
    submitter = parts.submitter
    return redrive(
        store,
        letters,
        submitter,
        targets,
        rate=request.rate,
        dry_run=request.dry_run,
        max_depth=parts.settings.max_queue_depth,
    )


# --- through an API ------------------------------------------------------------------------------


def _remote_list(args: argparse.Namespace) -> DeadLetterList:
    from kiln.tasks.client.client import KilnClient

    with KilnClient(args.api, api_key=args.api_key) as client:
        return client.dead_letters(owner=args.owner, cursor=args.cursor, limit=args.limit)


def _remote_show(args: argparse.Namespace) -> DeadLetterView:
    from kiln.tasks.client.client import KilnClient

    with KilnClient(args.api, api_key=args.api_key) as client:
        return client.dead_letter(args.job_id)


def _remote_redrive(args: argparse.Namespace, request: RedriveRequest) -> RedriveResult:
    from kiln.tasks.client.client import KilnClient

    with KilnClient(args.api, api_key=args.api_key) as client:
        return client.redrive(request)


# --- text output ---------------------------------------------------------------------------------


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _error_text(error: dict[str, Any] | None) -> str:
    if not error:
        return "-"
    return f"{error.get('type')}: {error.get('message')}"


def _describe_page(page: DeadLetterList) -> str:
    if not page.dead_letters:
        return "no dead letters"
    lines = []
    for d in page.dead_letters:
        redriven = f"\tredriven to {d.redriven_to}" if d.redriven_to else ""
        lines.append(
            f"{d.id}\t{_when(d.dead_at)}\t{d.pipeline or '-'}\t{d.attempts} attempt(s)\t"
            f"{_error_text(d.error)}{redriven}"
        )
    if page.next_cursor:
        lines.append(f"more: --cursor {page.next_cursor}")
    return "\n".join(lines)


def _describe_letter(d: DeadLetterView) -> str:
    lines = [
        f"job {d.id} failed at {_when(d.dead_at)}{f' (poison: {d.poison})' if d.poison else ''}",
        f"owner: {d.owner or '-'}  pipeline: {d.pipeline or '-'}  lane: {d.lane}",
        f"error: {_error_text(d.error)}",
        f"attempts: {d.attempts}",
    ]
    for a in d.attempt_log:
        lines.append(
            f"  #{a.attempt} on {a.node or '-'}: {_when(a.started_at)} -> {_when(a.ended_at)} "
            f"{a.outcome or 'open'}: {_error_text(a.error)}"
        )
    lines.append(f"checkpoint: {d.checkpoint or '-'}")
    if d.redriven_to:
        lines.append(f"redriven to {d.redriven_to} at {_when(d.redriven_at)}")
    return "\n".join(lines)


def _describe_redrive(result: RedriveResult) -> str:
    lines = []
    for item in result.results:
        extra = f" -> {item.new_job_id}" if item.new_job_id else ""
        note = f" ({item.message})" if item.message else ""
        lines.append(f"{item.id}\t{item.outcome}{extra}{note}")
    verb = "would redrive" if result.dry_run else "redriven"
    count = sum(1 for i in result.results if i.outcome == "would_redrive")
    lines.append(f"{count if result.dry_run else result.redriven} {verb} at {result.rate:g}/s")
    return "\n".join(lines)
