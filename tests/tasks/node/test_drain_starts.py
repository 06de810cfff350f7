"""The SIGTERM drain's first pass (tasks/node/drain.py `hand_back_at_once`) on a real node.

A job whose start is on its way to Redis (the record may already say `running`) is a running
job to the drain: an image job then gets the grace to finish, as any running image job does,
instead of being handed back as if it still waited (CI saw the record `running` and the job
handed back, queued, in that window).
"""

from __future__ import annotations

from kiln.common.stops import StopReason
from kiln.tasks.node.drain import hand_back_at_once
from tests.tasks.node.conftest import NodeHarness


def test_a_job_whose_start_is_under_way_is_not_handed_back_as_waiting(
    harness: NodeHarness,
) -> None:
    waiting, starting, running = (harness.submit() for _ in range(3))
    token = harness.store.acquire_lease
    with (
        harness.node.tracking(waiting, token(waiting, "n/1")) as held,
        harness.node.tracking(starting, token(starting, "n/2")) as on_its_way,
        harness.node.tracking(running, token(running, "n/3")) as started,
    ):
        on_its_way.starting = True
        started.started = True
        handed = hand_back_at_once(harness.node)
        assert [t.job_id for t in handed] == [waiting]
        assert held.stop_reason == StopReason.HANDED_BACK
        assert (on_its_way.stop_reason, started.stop_reason) == (None, None)  # the grace's
