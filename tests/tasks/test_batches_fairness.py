"""The bulk lane shared fairly and Redis bounded by the window, over real HTTP and Redis.

The window is sized from real node heartbeats; "nodes" here take jobs from the publish order (a
lane's queue is consumed in order), as a feeder is driven by hand (tests/tasks/test_batches.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchFeeding
from kiln.tasks.batches.fairness import capacities, window_size
from tests.tasks.helpers import Api, ApiFactory, drive_to_success
from tests.tasks.test_batches import feeder, finish_queued, get_batch, jsonl, lines_of, post_batch
from tests.tasks.test_batches import results as result_lines


def heartbeat(api: Api, node_id: str, pipelines: list[str], devices: int, **info: Any) -> None:
    devices_list = [f"cpu:{n}" for n in range(devices)]
    info = {"pipelines": pipelines, "devices": devices_list, **info}
    api.store.publish_node(node_id, info, ttl_s=60)


def test_the_window_is_sized_from_the_live_nodes_serving_the_pipeline(
    make_api: ApiFactory,
) -> None:
    api = make_api(batch_window=40, batch_window_min=3, batch_window_factor=2.0)
    assert window_size(capacities(api.store.live_nodes()), "tiny", api.settings) == 3  # floor
    heartbeat(api, "n1", ["tiny"], devices=4, group_size=2, max_batch=2)  # 2 groups × 2
    heartbeat(api, "n2", ["tiny", "other"], devices=1)  # 1 group × the default max batch, 4
    heartbeat(api, "n3", ["other"], devices=8, group_size=1)  # serves another pipeline
    nodes = capacities(api.store.live_nodes())
    assert nodes == {"": 4 + 4 + 8 * 4, "tiny": 4 + 4, "other": 4 + 8 * 4}
    assert window_size(nodes, "tiny", api.settings) == 2 * (4 + 4)
    assert window_size(nodes, None, api.settings) == 40  # any node counts, up to the cap
    batch_id = post_batch(api, jsonl(lines_of(30)), pipeline="tiny").json()["id"]
    feed, published = feeder(api, batch_window=40, batch_window_min=3, batch_window_factor=2.0)
    feed.tick()
    assert len(published.calls) == 16
    assert get_batch(api, batch_id)["counts"]["queued"] == 16


def test_keys_share_the_bulk_lane_evenly_however_many_batches_each_has(api: Api) -> None:
    for _ in range(5):
        assert post_batch(api, jsonl(lines_of(12)), who="alice").status_code == 201
    assert post_batch(api, jsonl(lines_of(60)), who="bob").status_code == 201
    feed, published = feeder(api, batch_window=4)
    owner_of = {api.key_ids["alice"]: "alice", api.key_ids["bob"]: "bob"}
    ran: Counter[str] = Counter()
    taken = 0
    for _ in range(12):
        feed.tick()
        # nodes take the four oldest jobs of the lane's queue, in the order they were published
        for job_id, _queue in published.calls[taken : taken + 4]:
            record = drive_to_success(api.store, job_id)
            ran[owner_of[str(record.owner)]] += 1
        taken = min(len(published.calls), taken + 4)
    assert sum(ran.values()) == 48
    assert 0.4 <= ran["alice"] / 48 <= 0.6, ran


def test_redis_holds_the_window_not_the_batch(make_api: ApiFactory) -> None:
    api = make_api(batch_item_retention_s=0)
    batch_id = post_batch(api, jsonl(lines_of(40))).json()["id"]
    feed, _ = feeder(api, batch_window=4, batch_item_retention_s=0)
    keys = api.store.keys
    most_keys = most_indexed = 0
    for _ in range(30):
        feed.tick()
        finish_queued(api, batch_id)
        api.store.prune_indexes()
        job_keys = sum(1 for _ in api.store.redis.scan_iter(keys.job_prefix + "*", count=1000))
        most_keys = max(most_keys, job_keys)
        most_indexed = max(most_indexed, int(api.store.redis.zcard(keys.all_index)))
        if get_batch(api, batch_id)["status"] == "completed":
            break
    assert get_batch(api, batch_id)["status"] == "completed"
    # a job has a record and an event stream: at most the window of them is alive at once
    assert most_keys <= 2 * 4, most_keys
    assert most_indexed <= 4, most_indexed
    assert BatchFeeding(api.store.redis, api.store.settings).open_items(batch_id) == []
    lines = result_lines(api, batch_id)  # the results are the durable record
    assert [line["status"] for line in lines[:-1]] == [str(JobState.SUCCEEDED)] * 40


def test_feeders_read_the_heartbeats_once_per_interval_for_all(make_api: ApiFactory) -> None:
    """Three feeders ticking: one heartbeat read per interval in all, not one per feeder, tick."""
    api = make_api(batch_window=40, batch_window_min=3, batch_window_factor=2.0)
    heartbeat(api, "n1", ["tiny"], devices=1, max_batch=2)
    post_batch(api, jsonl(lines_of(30)), pipeline="tiny")
    reads: list[int] = []
    live_nodes = api.store.live_nodes

    def counted() -> list[dict[str, Any]]:
        reads.append(1)
        return live_nodes()

    api.store.live_nodes = counted  # type: ignore[method-assign]  # the real read, counted
    feeders = [feeder(api, owner=f"node-{n}", heartbeat_interval_s=60.0)[0] for n in range(3)]
    for _ in range(5):
        for feed in feeders:
            feed.tick()
    assert len(reads) == 1  # 15 ticks within one interval
    # a node that starts meanwhile counts from the next interval on: the view is not re-read
    heartbeat(api, "n2", ["tiny"], devices=1, max_batch=2)
    feeders[1].tick()
    assert len(reads) == 1
