"""Held deliveries (storage/nodes.py).

Each heartbeat records the job messages a node holds; a lapsed list is handed out once.
"""

from __future__ import annotations

import time

from kiln.storage.status import JobStore


def test_a_live_nodes_list_is_not_claimed(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-1", "job-2"], ttl_s=60)
    assert job_store.claim_lapsed_held() == []
    assert job_store.redis.hexists(job_store.keys.held_deliveries, "node-a")


def test_a_lapsed_list_is_claimed_once(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-2", "job-1"], ttl_s=0.05)
    job_store.record_held("node-b", ["job-3"], ttl_s=60)
    time.sleep(0.1)
    assert job_store.claim_lapsed_held() == ["job-1", "job-2"]
    assert job_store.claim_lapsed_held() == []  # a second sweeper gets nothing
    assert job_store.redis.hkeys(job_store.keys.held_deliveries) == ["node-b"]


def test_each_heartbeat_replaces_the_list_and_an_empty_one_removes_it(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-1"], ttl_s=0.05)
    job_store.record_held("node-a", ["job-9"], ttl_s=0.05)
    time.sleep(0.1)
    assert job_store.claim_lapsed_held() == ["job-9"]
    job_store.record_held("node-a", ["job-1"], ttl_s=60)
    job_store.record_held("node-a", [], ttl_s=60)
    assert not job_store.redis.exists(job_store.keys.held_deliveries)
