"""`kiln control`: the cluster's loops alone, in a CPU-only process that never imports torch.

Beside nodes started with `KILN_NODE_CONTROL_LOOPS=false` (or instead of their loops: several
may run, each component is safe with many: tasks/control/room.py). SIGTERM or SIGINT stops the
loops (a step under way finishes) and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

from kiln.common.logs import configure_logging
from kiln.tasks.control.components import Loops
from kiln.tasks.control.context import ControlContext
from kiln.tasks.control.room import cluster_components, served_queues
from kiln.tasks.queue.process import ProcessParts

log = logging.getLogger(__name__)


def run_control(parts: ProcessParts, loglevel: str) -> None:
    """Run the cluster's loops until SIGTERM or SIGINT."""
    configure_logging(parts.settings.log_format, loglevel, static={"component": "control"})
    ctx = ControlContext.of(parts)
    loops = Loops(cluster_components(ctx, lambda: served_queues(ctx)))

    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("kiln control: %s, stopping", signal.Signals(signum).name)
        loops.ask_to_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    loops.start()
    log.info(
        "kiln control %s: %s (%s)",
        ctx.owner,
        ", ".join(loops.names),
        ctx.storage_settings.describe(),
    )
    try:
        loops.wait()
    finally:
        loops.stop()
        ctx.celery_app.close()
        ctx.store.redis.close()
