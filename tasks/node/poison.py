"""Poison: a job Kiln fails for good, whatever attempts it has left (docs/contract.md §5a).

A job is poison when running it again can only do harm or fail the same way:
- it broke its worker group twice (`WorkerGroupDied` ended two of its attempts): a third run
  would take the group, and every job batched with it, down again;
- it ran out of device memory (`OutOfMemory`): Kiln runs no smaller batch than a job's own;
- its image inputs are ones no node can use (`ImageInputRejected`: unreadable, undecodable, of a
  refused kind or size; every node checks them the same way).
Its error keeps the cause's type and message and gains `poison: <reason>` and `retryable: false`;
the job goes to `failed`, so into the dead letters, and only a redrive runs it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kiln.storage.dead_letters import POISON

GROUP_DIED = "WorkerGroupDied"
# the error types that make a job poison at once, and the reason each gives
AT_ONCE = {"OutOfMemory": "out_of_memory", "ImageInputRejected": "unusable_inputs"}
GROUP_BROKEN_TWICE = "group_broken_twice"


def poison_reason(
    error: dict[str, Any], earlier_attempts: Callable[[], Sequence[dict[str, Any]]]
) -> str | None:
    """Why the attempt that ended with `error` makes its job poison, or None.

    `earlier_attempts` reads the job's attempt log (storage: each run's end and error); it is
    called only for a group's death.
    """
    kind = str(error.get("type"))
    if kind in AT_ONCE:
        return AT_ONCE[kind]
    if kind != GROUP_DIED:
        return None
    ended = [a for a in earlier_attempts() if a.get("ended_at") is not None]
    if any((a.get("error") or {}).get("type") == GROUP_DIED for a in ended):
        return GROUP_BROKEN_TWICE
    return None


def poisoned(error: dict[str, Any], reason: str) -> dict[str, Any]:
    """The job's final error: the cause's, not retryable, naming the reason."""
    return {**error, "retryable": False, POISON: reason}
