"""Views of the cluster one node computes per interval for every node (storage/backlog.py).

What an idle node's surplus watch and every batch feeder read each tick (every heartbeat, every
running job) is read by one node per interval: the claim is granted once per interval, the view
outlives it, and a node that claimed nothing reads the view another wrote.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kiln.storage.job_store import JobStore


def test_one_claim_per_interval_and_every_node_reads_the_view(job_store: JobStore) -> None:
    (view,) = job_store.shared_views(["surplus:sleepy"]).values()
    assert (view.value, view.due) == (None, True)
    claims = [job_store.claim_shared_view("surplus:sleepy", f"node-{n}", 0.3) for n in range(5)]
    assert claims == [True, False, False, False, False]
    job_store.write_shared_view("surplus:sleepy", {"desired": 1, "live": 3}, ttl_s=1.0)
    (view,) = job_store.shared_views(["surplus:sleepy"]).values()
    assert (view.value, view.due) == ({"desired": 1, "live": 3}, False)
    time.sleep(0.4)  # the interval passed: due again, the last view still read meanwhile
    (view,) = job_store.shared_views(["surplus:sleepy"]).values()
    assert (view.value, view.due) == ({"desired": 1, "live": 3}, True)
    assert job_store.claim_shared_view("surplus:sleepy", "node-4", 0.3)


def test_a_lapsed_list_is_found_among_many_live_ones(job_store: JobStore) -> None:
    """The claim finds a lapse in the deadline index; the live lists come with it, once."""
    for n in range(50):
        job_store.record_held(f"live-{n}", [f"job-{n}"], ttl_s=30)
    job_store.record_held("dying", ["job-x"], ttl_s=0.05)
    assert job_store.claim_lapsed_holders().holders == []  # nothing lapsed yet: no live list
    time.sleep(0.1)
    claim = job_store.claim_lapsed_holders()
    assert [holder.node_id for holder in claim.holders] == ["dying"]
    assert claim.live_job_ids == {f"job-{n}" for n in range(50)}
    assert job_store.claim_lapsed_holders().holders == []
    assert job_store.redis.zcard(job_store.keys.held_deadlines) == 50


def test_shared_view_is_computed_once_per_interval_for_every_caller(job_store: JobStore) -> None:
    computed: list[str] = []

    def compute_as(owner: str) -> Callable[[], dict[str, Any]]:
        def compute() -> dict[str, Any]:
            computed.append(owner)
            return {"by": owner}

        return compute

    views = [
        job_store.shared_view("feeding:capacity", f"node-{n}", 0.3, compute_as(f"node-{n}"))
        for n in range(5)
    ]
    assert computed == ["node-0"]  # the first claims and computes; the others read its view
    assert views == [{"by": "node-0"}] * 5
    time.sleep(0.4)  # due again: the next caller computes it, the rest read the new one
    views = [
        job_store.shared_view("feeding:capacity", f"node-{n}", 0.3, compute_as(f"node-{n}"))
        for n in (3, 1, 2)
    ]
    assert computed == ["node-0", "node-3"]
    assert views == [{"by": "node-3"}] * 3
