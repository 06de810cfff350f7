"""`python -m tests.e2e.dies_before_listing worker ...`: a `kiln worker` that dies at one moment.

The process is a real node (heartbeat, held list, Celery consumer, kombu's Redis transport); the
one change is that it exits at once, as a SIGKILL would end it, when its `run_job` strategy is
about to list its first message as held: after kombu recorded the delivery as unacknowledged,
before any list names it (tests/e2e/test_held_recovery.py). No timing reaches that moment otherwise.
"""

from __future__ import annotations

import os
import sys

from kiln.tasks.cli.main import main
from kiln.tasks.node.held import HeldDeliveries


def die_before_listing(*_: object) -> None:
    """Exit without cleanup: no ack, no restore, no shutdown of the node."""
    os._exit(137)


HeldDeliveries.received = die_before_listing  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main())
