"""The queue order a node consumes in: interactive first, bulk never starved (queue.lanes)."""

from __future__ import annotations

from kiln.tasks.queue.lanes import LanePriorityCycle, node_queues, queue_name


def test_node_queues_put_interactive_lanes_first() -> None:
    queues = node_queues(["bulk", "interactive"], ["tiny", "sd3"])
    assert queues == ["interactive.tiny", "interactive.sd3", "bulk.tiny", "bulk.sd3"]
    assert queue_name("bulk", "tiny") == "bulk.tiny"


def simulate(cycle: LanePriorityCycle, waiting: dict[str, int], fetches: int) -> list[str]:
    """Drive the cycle as kombu's BRPOP does: the first non-empty queue in its order delivers."""
    delivered = []
    for _ in range(fetches):
        order = cycle.consume(len(cycle.items))
        queue = next((q for q in order if waiting[q] > 0), None)
        if queue is None:
            break
        waiting[queue] -= 1
        cycle.rotate(queue)
        delivered.append(queue.split(".")[0])
    return delivered


def test_interactive_first_but_bulk_gets_one_in_every_five_under_load() -> None:
    cycle = LanePriorityCycle(["interactive.tiny", "bulk.tiny"])
    delivered = simulate(cycle, {"interactive.tiny": 100, "bulk.tiny": 100}, fetches=20)
    assert delivered[:5] == ["interactive"] * 4 + ["bulk"]
    assert delivered.count("bulk") == 4  # 1 in every bulk_every + 1 = 5


def test_bulk_gets_everything_when_interactive_is_idle() -> None:
    cycle = LanePriorityCycle(["interactive.tiny", "bulk.tiny"])
    delivered = simulate(cycle, {"interactive.tiny": 0, "bulk.tiny": 7}, fetches=10)
    assert delivered == ["bulk"] * 7


def test_interactive_is_never_held_back_when_bulk_is_empty() -> None:
    cycle = LanePriorityCycle(["interactive.tiny", "bulk.tiny"])
    delivered = simulate(cycle, {"interactive.tiny": 12, "bulk.tiny": 0}, fetches=12)
    assert delivered == ["interactive"] * 12
