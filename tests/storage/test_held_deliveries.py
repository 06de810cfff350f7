"""Held deliveries (storage/nodes.py).

Each heartbeat records the job messages a node holds; a lapsed list is handed out once.
"""

from __future__ import annotations

import time

from kiln.storage.job_store import JobStore


def claim_lapsed_held(store: JobStore) -> list[str]:
    """The job ids of the held lists a sweeper's claim hands out (each list once)."""
    return sorted({j for holder in store.claim_lapsed_holders().holders for j in holder.job_ids})


def test_a_live_nodes_list_is_not_claimed(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-1", "job-2"], ttl_s=60)
    assert claim_lapsed_held(job_store) == []
    assert job_store.redis.hexists(job_store.keys.held_deliveries, "node-a")


def test_a_lapsed_list_is_claimed_once(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-2", "job-1"], ttl_s=0.05)
    job_store.record_held("node-b", ["job-3"], ttl_s=60)
    time.sleep(0.1)
    assert claim_lapsed_held(job_store) == ["job-1", "job-2"]
    assert claim_lapsed_held(job_store) == []  # a second sweeper gets nothing
    assert job_store.redis.hkeys(job_store.keys.held_deliveries) == ["node-b"]


def test_each_heartbeat_replaces_the_list(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-1"], ttl_s=0.05)
    job_store.record_held("node-a", ["job-9"], ttl_s=0.05)
    time.sleep(0.1)
    assert claim_lapsed_held(job_store) == ["job-9"]


def test_an_empty_list_keeps_the_node_so_its_lapse_is_seen(job_store: JobStore) -> None:
    # A node killed before it lists a message must still lapse visibly (tasks/control/unacked.py).
    job_store.record_held("node-a", ["job-1"], ttl_s=0.05)
    job_store.record_held("node-a", [], ttl_s=0.05)
    time.sleep(0.1)
    claim = job_store.claim_lapsed_holders()
    assert [(h.node_id, h.job_ids) for h in claim.holders] == [("node-a", [])]
    assert not job_store.redis.exists(job_store.keys.held_deliveries)


def test_a_lapsed_holder_carries_the_window_it_died_in(job_store: JobStore) -> None:
    before_ms = job_store.redis.time()[0] * 1000
    job_store.record_held("node-a", ["job-1"], ttl_s=0.05)
    time.sleep(0.1)
    (holder,) = job_store.claim_lapsed_holders().holders
    assert holder.deadline_ms - holder.written_ms == 50
    assert holder.written_ms >= before_ms


def test_live_nodes_jobs_come_with_a_lapse_only(job_store: JobStore) -> None:
    job_store.record_held("node-live", ["job-1", "job-2"], ttl_s=60)
    job_store.record_held("node-idle", [], ttl_s=60)
    assert job_store.claim_lapsed_holders().live_job_ids == set()  # no lapse: not read
    job_store.record_held("node-dead", ["job-3"], ttl_s=0.05)
    time.sleep(0.1)
    claim = job_store.claim_lapsed_holders()
    assert [h.node_id for h in claim.holders] == ["node-dead"]
    assert claim.live_job_ids == {"job-1", "job-2"}


def test_unacked_deliveries_reads_one_window_oldest_first(job_store: JobStore) -> None:
    index, deliveries = f"{job_store.keys.ns}:celery:unacked_index", f"{job_store.keys.ns}:d"
    job_store.redis.zadd(index, {"t1": 100.0, "t2": 105.0, "t3": 110.0, "t4": 200.0})
    job_store.redis.hset(deliveries, mapping={"t1": "m1", "t3": "m3", "t4": "m4"})  # t2 acked
    assert job_store.unacked_deliveries(index, deliveries, 100.0, 150.0, limit=10) == ["m1", "m3"]
    assert job_store.unacked_deliveries(index, deliveries, 100.0, 150.0, limit=1) == ["m1"]
    assert job_store.unacked_deliveries(index, deliveries, 300.0, 400.0, limit=10) == []


def test_a_restarted_node_does_not_erase_what_its_previous_life_held(job_store: JobStore) -> None:
    # A node restarted with a fixed --node-id (compose) writes under the same id at once.
    job_store.record_held("node-a", ["job-1"], ttl_s=0.05, incarnation="first")
    job_store.record_held("node-a", [], ttl_s=60, incarnation="second")
    time.sleep(0.1)
    claim = job_store.claim_lapsed_holders()
    assert [(h.node_id, h.job_ids) for h in claim.holders] == [("node-a~first", ["job-1"])]
    assert job_store.redis.hkeys(job_store.keys.held_deliveries) == ["node-a"]


def test_the_same_process_replaces_its_own_list(job_store: JobStore) -> None:
    job_store.record_held("node-a", ["job-1"], ttl_s=0.05, incarnation="first")
    job_store.record_held("node-a", ["job-2"], ttl_s=0.05, incarnation="first")
    time.sleep(0.1)
    assert claim_lapsed_held(job_store) == ["job-2"]


def test_an_entry_written_before_the_window_existed_is_claimed(job_store: JobStore) -> None:
    job_store.redis.hset(job_store.keys.held_deliveries, "node-old", "1000 job-1 job-2")
    (holder,) = job_store.claim_lapsed_holders().holders
    assert (holder.written_ms, holder.deadline_ms, holder.job_ids) == (
        1000,
        1000,
        ["job-1", "job-2"],
    )
