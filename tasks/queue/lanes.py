"""Queue names and the order a node consumes them in.

Policy: a node serves interactive queues strictly first, except that after `bulk_every`
consecutive interactive deliveries it offers the bulk queues first once. Under sustained
interactive load bulk therefore still gets at least 1 in `bulk_every + 1` of a node's deliveries;
when interactive is idle bulk gets everything. kombu's Redis transport asks this cycle for the
BRPOP key order before every fetch and tells it which queue delivered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kiln.common.request import Lane
from kiln.tasks.contract.settings import KilnSettings

LANES: tuple[Lane, ...] = tuple(Lane)  # in priority order
WEBHOOKS_QUEUE = "webhooks"
DEFAULT_BULK_EVERY: int = KilnSettings.model_fields["bulk_share_every"].default


def queue_name(lane: str, pipeline: str) -> str:
    """The Celery queue of one lane and pipeline, e.g. `interactive.tiny`."""
    return f"{lane}.{pipeline}"


def lane_and_pipeline(queue: str) -> tuple[str, str]:
    """The lane and pipeline a `queue_name` joins (a lane holds no '.'; a pipeline name may)."""
    lane, _, pipeline = queue.partition(".")
    return lane, pipeline


def node_queues(lanes: Sequence[str], pipelines: Sequence[str]) -> list[str]:
    """Every queue a node serving these pipelines consumes, interactive lanes before bulk."""
    ordered = sorted(lanes, key=_lane_rank)  # a bare lane name ranks as its queue would
    return [queue_name(lane, pipeline) for lane in ordered for pipeline in pipelines]


class LanePriorityCycle:
    """kombu queue cycle: interactive first, bulk let through once every `bulk_every`."""

    bulk_every = DEFAULT_BULK_EVERY

    def __init__(self, items: list[str] | None = None) -> None:
        self.items: list[str] = items if items is not None else []
        self.interactive_in_a_row = 0

    def update(self, items: Iterable[str]) -> None:
        """Replace the consumed queues (kombu calls this when queues are added or removed).

        kombu lists a queue added back (`add_consumer` after a pause) last; the lanes' order is
        restored here, so a resumed interactive queue still goes before bulk.
        """
        self.items[:] = sorted(items, key=_lane_rank)

    def consume(self, n: int) -> list[str]:
        """The BRPOP order for the next fetch."""
        queues = self.items[:n]
        if self.interactive_in_a_row < self.bulk_every:
            return queues
        bulk = [q for q in queues if not _is_interactive(q)]
        return bulk + [q for q in queues if _is_interactive(q)]

    def rotate(self, last_used: str) -> str:
        """Record which queue delivered the last message."""
        if _is_interactive(last_used):
            self.interactive_in_a_row += 1
        else:
            self.interactive_in_a_row = 0
        return last_used


def _lane_rank(queue: str) -> int:
    lane = queue.partition(".")[0]
    return LANES.index(lane) if lane in LANES else len(LANES)


def _is_interactive(queue: str) -> bool:
    return queue.startswith(Lane.interactive)
