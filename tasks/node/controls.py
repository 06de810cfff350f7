"""Operator controls on one node (docs/operations.md §10): queue pauses and its drain request.

The maintenance loop polls both from Redis (`NodeControls.poll`, every `CONTROL_POLL_S`) and applies
them to this node's own Celery worker through Celery's remote control, `cancel_consumer` and
`add_consumer` addressed to the worker's node name: a paused queue is no longer consumed, a
resumed one is again; a draining node consumes nothing. A message fetched before the change
lands is not started either: `run_job` re-publishes a delivery from a paused queue, or on a
draining node, after `KILN_LEASE_BUSY_DELAY_S` (tasks.node.jobs). A node started while a queue is
paused never consumes it (`kiln worker` leaves it out of the queues it starts with).

A drain lets running jobs finish and takes nothing new; the heartbeat says `draining`. With
`exit`, the node then stops itself as SIGTERM would (with nothing left to hand back) and withdraws
its drain request, so a node started again under the same id serves. Without it the node stays
up, idle, until the request is withdrawn (`kiln admin undrain`).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from celery import Celery

from kiln.tasks.node.node import Node

log = logging.getLogger(__name__)

CONTROL_POLL_S = 0.5
# a remote-control command that gets no answer in this time is sent again at the next poll
CONTROL_REPLY_TIMEOUT_S = 2.0


class ConsumerSwitch(Protocol):
    """Stops or starts consuming one queue on this node's worker; True once the worker agreed."""

    def cancel(self, queue: str) -> bool:
        """Stop consuming `queue`."""
        ...

    def add(self, queue: str) -> bool:
        """Start consuming `queue` again."""
        ...

    def is_ready(self) -> bool:
        """Whether the worker consumes yet (before that, commands would be lost)."""
        ...


class CeleryConsumers:
    """A ConsumerSwitch through Celery's remote control, addressed to this worker only.

    Inert until `ready` names the worker (Celery's `worker_ready`): a command sent before the
    worker listens would be lost.
    """

    def __init__(self, app: Celery, timeout_s: float = CONTROL_REPLY_TIMEOUT_S) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self.hostname: str | None = None

    def ready(self, hostname: str) -> None:
        """The worker consumes now, under this node name (`<node id>@<host>`)."""
        self.hostname = hostname

    def is_ready(self) -> bool:
        """Whether `ready` has named the worker."""
        return self.hostname is not None

    def cancel(self, queue: str) -> bool:
        """`celery control cancel_consumer QUEUE -d <this worker>`."""
        if self.hostname is None:
            return False
        replies = self.app.control.cancel_consumer(
            queue, destination=[self.hostname], reply=True, timeout=self.timeout_s
        )
        return _agreed(replies, self.hostname)

    def add(self, queue: str) -> bool:
        """`celery control add_consumer QUEUE -d <this worker>`."""
        if self.hostname is None:
            return False
        replies = self.app.control.add_consumer(
            queue, destination=[self.hostname], reply=True, timeout=self.timeout_s
        )
        return _agreed(replies, self.hostname)


def _agreed(replies: Any, hostname: str) -> bool:
    return any(
        isinstance(reply, dict) and "ok" in (reply.get(hostname) or {}) for reply in replies or []
    )


def send_sigterm() -> None:
    """Stop this worker as SIGTERM does: Celery's warm shutdown, then the node's."""
    os.kill(os.getpid(), signal.SIGTERM)


class NodeControls:
    """Keeps a node's consumption in line with the pauses and its drain request."""

    def __init__(
        self,
        node: Node,
        queues: Sequence[str],
        switch: ConsumerSwitch | None = None,
        on_exit: Callable[[], None] = send_sigterm,
    ) -> None:
        self.node = node
        self.queues = list(queues)  # the job queues this node serves, in priority order
        self.switch = switch
        self.on_exit = on_exit
        self.exiting = False
        self._consuming: set[str] = set(self.queues)
        self.held_at_start: list[str] = []  # queues the worker leaves out when it starts

    def start_queues(self) -> list[str]:
        """Read the controls once; the queues the worker starts with (none paused or draining)."""
        self.poll_flags()
        self._consuming = set(self._wanted())
        self._publish_consuming()
        self.held_at_start = [q for q in self.queues if q not in self._consuming]
        return [q for q in self.queues if q in self._consuming]

    def poll(self) -> None:
        """One poll: read the flags, apply them to the worker, exit after a drain if asked."""
        self.poll_flags()
        self._apply()
        self._exit_when_drained()

    def poll_flags(self) -> None:
        """Read the pauses and this node's drain request into the node's state."""
        node, state = self.node, self.node.controls
        paused, drain = node.store.node_controls(node.node_id)
        state.paused = frozenset(paused)
        if drain is not None and state.drain is None:
            log.info("node %s: draining (operator request%s)", node.node_id,
                     ", exit when idle" if drain.exit else "")  # fmt: skip
            node.draining.set()
        elif drain is None and state.drain is not None and not state.shutting_down:
            log.info("node %s: drain withdrawn; taking jobs again", node.node_id)
            node.draining.clear()
        state.drain = drain

    def _wanted(self) -> list[str]:
        if self.node.draining.is_set() or self.node.quarantine.reason is not None:
            return []
        return [q for q in self.queues if q not in self.node.controls.paused]

    def _apply(self) -> None:
        if self.switch is None:
            return
        # Once SIGTERM (or a finished drain) stops the worker, Celery's warm shutdown stops every
        # consumer itself and answers no remote control: a cancel sent then would only wait out
        # its reply timeout, once per queue, and hold the node's exit back by as much.
        if self.node.controls.shutting_down:
            self._consuming.clear()
            self._publish_consuming()
            return
        wanted = set(self._wanted())
        for queue in [q for q in self.queues if q in self._consuming - wanted]:
            if self.switch.cancel(queue):
                self._consuming.discard(queue)
                log.info("node %s: stopped consuming %s", self.node.node_id, queue)
        for queue in [q for q in self.queues if q in wanted - self._consuming]:
            if self.switch.add(queue):
                self._consuming.add(queue)
                log.info("node %s: consuming %s again", self.node.node_id, queue)
        self._publish_consuming()

    def _publish_consuming(self) -> None:
        self.node.controls.consuming = tuple(q for q in self.queues if q in self._consuming)

    def _exit_when_drained(self) -> None:
        drain, stopping = self.node.controls.drain, self.node.controls.shutting_down
        if drain is None or not drain.exit or self.exiting or stopping or self.node.tracked_jobs():
            return  # (a second SIGTERM would cut Celery's warm shutdown short)
        if self._consuming or (self.switch is not None and not self.switch.is_ready()):
            return  # consumption not stopped yet, or Celery not up to handle SIGTERM
        self.exiting = True
        self.node.controls.shutting_down = True
        self.node.store.withdraw_drain(self.node.node_id)
        log.info("node %s: drained; exiting", self.node.node_id)
        self.on_exit()
