"""`kiln worker`'s logging: with `KILN_LOG_FORMAT=json`, Celery logs through Kiln's handler.

Kiln sets the root handler up before Celery starts (kiln/common/logs.py), then answers Celery's
`setup_logging` signal, which makes Celery leave the handlers alone (it only takes the level of
`--loglevel` from it) and skip its stdout redirection; the worker runs with `--quiet`, so no text
banner is printed. Celery's own lines about a `run_job` (received, succeeded, failed) carry the
job's id: `task_prerun`/`task_postrun` bind it around each task. Text mode is Celery's own setup,
with a text handler of Kiln's until Celery's replaces it (the node's start-up lines).
"""

from __future__ import annotations

import logging
import threading
from contextvars import Token
from multiprocessing import resource_tracker
from types import MappingProxyType
from typing import Any

from celery.signals import setup_logging, task_postrun, task_prerun

from kiln.common.logs import (
    StdioCapture,
    bind_log_context,
    configure_logging,
    reset_log_context,
    start_json_logging,
)
from kiln.tasks.queue.app import RUN_JOB_TASK

# (task id, thread) -> the task's context binding; set and reset on the task's own thread
_tokens: dict[tuple[str, int], Token[MappingProxyType[str, Any]]] = {}


def start_worker_logging(
    log_format: str, loglevel: str, node_id: str | None, *, spawns_ranks: bool = True
) -> StdioCapture | None:
    """Set JSON logging up for this worker and its ranks; None in text mode (Celery's own)."""
    if log_format != "json":
        # Celery sets its text logging up only as the worker starts (replacing this handler):
        # until then the root logger's level is WARNING, and the node's start-up lines and its
        # background loops' first ones (a lapse claimed in the first second) went nowhere.
        configure_logging("text", loglevel)
        return None
    if spawns_ranks:
        # multiprocessing's resource tracker, started at the first rank spawn, outlives the
        # node until this process exits. Started after the capture, it would inherit the
        # captured fds 1 and 2 and keep their pipes open, and `capture.stop()` would wait out
        # its timeout for an end of file that cannot come. Started first, it holds the real ones.
        resource_tracker.ensure_running()
    capture = start_json_logging(loglevel, static={"node_id": node_id})
    setup_logging.connect(_keep_kiln_handlers, weak=False)
    task_prerun.connect(_bind_task, weak=False)
    task_postrun.connect(_unbind_task, weak=False)
    return capture


def _keep_kiln_handlers(loglevel: int | str | None = None, **_: Any) -> None:
    """Celery's `setup_logging`: the handlers stay Kiln's; only the level follows Celery's."""
    if loglevel:
        logging.getLogger().setLevel(loglevel)


def _bind_task(task_id: str, task: Any, args: Any = (), **_: Any) -> None:
    """Before a task runs on its thread: its lines carry the task id, and the job's for run_job."""
    job_id = args[0] if getattr(task, "name", None) == RUN_JOB_TASK and args else None
    _tokens[task_id, threading.get_ident()] = bind_log_context(task_id=task_id, job_id=job_id)


def _unbind_task(task_id: str, **_: Any) -> None:
    """After the task (on the same thread): drop what `_bind_task` bound."""
    token = _tokens.pop((task_id, threading.get_ident()), None)
    if token is not None:
        reset_log_context(token)
