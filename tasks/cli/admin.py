"""`kiln admin`: operator controls (docs/operations.md §10), straight in Redis or through an API.

`nodes`, `queues`, `pause QUEUE`, `resume QUEUE`, `purge QUEUE`, `drain NODE [--exit]`,
`undrain NODE`.
Without `--api` they write Redis directly, as `kiln keys` does (whoever reaches Redis is trusted);
with `--api URL --api-key KEY` they call the API's /v1/admin routes, which need an admin key.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from kiln.tasks.cli.backends import remote_args
from kiln.tasks.cli.exits import UsageError, print_json

if TYPE_CHECKING:
    from kiln.tasks.queue.process import ProcessParts

ACTIONS = ("nodes", "queues", "pause", "resume", "purge", "drain", "undrain")


def add_parser(sub: Any) -> None:
    """`kiln admin ...` and its actions."""
    admin = sub.add_parser("admin", help="operator controls: pause, resume, purge, drain")
    actions = admin.add_subparsers(dest="admin_action", required=True)
    nodes = actions.add_parser(
        "nodes", help="list live nodes: pipelines, state, jobs, last heartbeat"
    )
    _common(nodes)
    listed = actions.add_parser("queues", help="list queues: queued jobs, paused or not")
    _common(listed)
    for name, text in (
        ("pause", "stop every node taking jobs from QUEUE (e.g. bulk.tiny); they stay queued"),
        ("resume", "let nodes take jobs from a paused QUEUE again"),
        ("purge", "cancel every job queued in QUEUE (running jobs go on)"),
    ):
        p = actions.add_parser(name, help=text)
        p.add_argument("queue", metavar="QUEUE", help="<lane>.<pipeline>, e.g. bulk.tiny")
        _common(p)
    drain = actions.add_parser("drain", help="let NODE finish its jobs and take no new ones")
    drain.add_argument("node_id", metavar="NODE", help="a node id (kiln worker --node-id)")
    drain.add_argument("--exit", action="store_true", help="then exit (else stay up, idle)")
    _common(drain)
    undrain = actions.add_parser("undrain", help="withdraw NODE's drain request")
    undrain.add_argument("node_id", metavar="NODE", help="a node id (kiln worker --node-id)")
    _common(undrain)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote_args(parser, key_help="an admin key for --api")


def run(args: argparse.Namespace) -> int:
    """Run one `kiln admin` action; returns the exit code."""
    result = _remote(args) if args.api else _direct(args)
    if args.json:
        print_json(result)
    elif args.admin_action == "nodes":
        from kiln.tasks.cli.admin_nodes import show_nodes

        show_nodes(result)
    else:
        print(_describe(args.admin_action, result))
    return 0


def _check_queue(queue: str) -> None:
    from kiln.tasks.queue.controls import InvalidQueue, parse_queue

    try:
        parse_queue(queue)
    except InvalidQueue as exc:
        raise UsageError(str(exc)) from exc


def _direct(args: argparse.Namespace) -> dict[str, Any]:
    # Deferred: Redis and Celery load only for this command.
    from kiln.tasks.queue import controls
    from kiln.tasks.queue.process import ProcessParts

    action = args.admin_action
    parts = ProcessParts()  # the command's process: its environment, read once
    settings, store = parts.settings, parts.store
    if action == "nodes":  # what GET /v1/nodes answers an admin key
        return {
            "nodes": store.live_nodes(),
            "paused_queues": sorted(store.paused_queues()),
            "drain_requests": sorted(store.drain_requests()),
        }
    if action == "queues":
        pipelines = set(settings.pipelines) | store.served_pipelines()
        states = controls.queue_states(store, pipelines)
        return {"queues": [dataclasses.asdict(state) for state in states]}
    if action in ("pause", "resume", "purge"):
        _check_queue(args.queue)
    if action == "pause":
        return {"queue": args.queue, "paused": True, "changed": controls.pause(store, args.queue)}
    if action == "resume":
        changed = controls.resume(store, args.queue)
        return {"queue": args.queue, "paused": False, "changed": changed}
    if action == "purge":
        job_ids = _purge(parts, args.queue)
        return {"queue": args.queue, "canceled": len(job_ids), "job_ids": job_ids}
    if action == "drain":
        controls.drain(store, args.node_id, exit=args.exit)
        return {"node_id": args.node_id, "drain_requested": True, "exit": args.exit}
    controls.undrain(store, args.node_id)
    return {"node_id": args.node_id, "drain_requested": False, "exit": False}


def _purge(parts: ProcessParts, queue: str) -> list[str]:
    from kiln.tasks.queue import controls
    from kiln.tasks.webhooks.event_sink import EventSink

    store, celery = parts.store, parts.celery_app
    try:
        return controls.purge(store, queue, on_canceled=EventSink(store, celery).changed)
    finally:
        celery.close()


def _remote(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.tasks.client.client import KilnClient

    action = args.admin_action
    if action in ("pause", "resume", "purge"):
        _check_queue(args.queue)
    with KilnClient(args.api, api_key=args.api_key) as client:
        if action == "nodes":
            return client.nodes().model_dump(mode="json")
        if action == "queues":
            return client.queues().model_dump(mode="json")
        if action == "pause":
            return client.pause_queue(args.queue).model_dump(mode="json")
        if action == "resume":
            return client.resume_queue(args.queue).model_dump(mode="json")
        if action == "purge":
            return client.purge_queue(args.queue).model_dump(mode="json")
        if action == "drain":
            return client.drain_node(args.node_id, exit=args.exit).model_dump(mode="json")
        return client.undrain_node(args.node_id).model_dump(mode="json")


def _describe(action: str, result: dict[str, Any]) -> str:
    if action == "queues":
        rows = [
            "\t".join([q["queue"], f"{q['queued']} queued", "paused" if q["paused"] else ""])
            for q in result["queues"]
        ]
        return "\n".join(row.rstrip() for row in rows) or "no queues"
    if action in ("pause", "resume"):
        word = "paused" if action == "pause" else "resumed"
        already = "paused already" if action == "pause" else "not paused"
        return f"queue {result['queue']} {word if result['changed'] else 'was ' + already}"
    if action == "purge":
        return f"queue {result['queue']} purged: {result['canceled']} queued jobs canceled"
    node = result["node_id"]
    if action == "drain":
        then = "exit once idle" if result["exit"] else "stay up, idle"
        return f"node {node} asked to drain: it finishes its running jobs, then will {then}"
    return f"node {node}: drain request withdrawn"
