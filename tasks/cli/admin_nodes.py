"""How `kiln admin nodes` shows the live nodes: one row per node, from its latest heartbeat."""

from __future__ import annotations

import time
from typing import Any

from kiln.tasks.cli.consoles import stdout_console
from kiln.tasks.cli.tables import age_text, fitting_table, whole_width

COLUMNS = ("node", "pipelines", "state", "running", "waiting", "heartbeat")


def node_state(node: dict[str, Any], drain_requests: list[str]) -> str:
    """What the node is doing: quarantined, draining, asleep, warming, drain requested, serving."""
    if node.get("quarantined"):
        return "quarantined"
    if node.get("draining"):
        return "draining"
    if node.get("node_id") in drain_requests:
        return "drain requested"
    if node.get("warming"):
        return "warming"
    if node.get("asleep"):
        return "asleep"
    return "serving"


def node_row(node: dict[str, Any], drain_requests: list[str], now: float) -> tuple[str, ...]:
    """One node's row: id, pipelines, state, jobs running and waiting in it, heartbeat's age."""
    beat = node.get("heartbeat_at")
    waiting = node.get("jobs_waiting")  # held for its group, not started yet
    return (
        str(node.get("node_id", "?")),
        ", ".join(str(name) for name in node.get("pipelines", [])) or "-",
        node_state(node, drain_requests),
        str(node.get("jobs_running", 0)),
        "-" if waiting is None else str(waiting),
        "-" if not isinstance(beat, int | float) else f"{age_text(now - beat)} ago",
    )


def show_nodes(result: dict[str, Any]) -> None:
    """The live nodes as a table on stdout, then the paused queues; `no live nodes` if none."""
    drains = list(result.get("drain_requests", []))
    rows = [node_row(node, drains, time.time()) for node in result.get("nodes", [])]
    if not rows:
        print("no live nodes")
    else:
        table = fitting_table(*COLUMNS, whole=("node", "state", "heartbeat"))
        for column in (0, 2, 5):
            whole_width(table, column, [row[column] for row in rows])
        # the list wraps between names, never inside one
        names = [name for row in rows for name in row[1].split(", ")]
        whole_width(table, 1, [name + "," for name in names])
        for row in rows:
            table.add_row(*row)
        stdout_console().print(table)
    paused = result.get("paused_queues", [])
    if paused:
        print(f"paused queues: {', '.join(paused)}")
