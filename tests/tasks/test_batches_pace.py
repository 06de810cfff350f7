"""The feeding window covers what the nodes finish before the feeder comes round again.

`Pace` is driven by a hand-moved clock (no wall-clock thresholds); the batches it reads are real
ones, recorded through the API in real Redis, with their counters as the job scripts move them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.common.states import JobState
from kiln.storage.batch_records import FedBatch
from kiln.storage.batch_store import BatchStore
from kiln.tasks.batches.fairness import REFILL_PASSES, Pace
from tests.tasks.helpers import Api, ApiFactory
from tests.tasks.test_batches import feeder, finish_queued, get_batch, jsonl, lines_of, post_batch
from tests.tasks.test_batches_fairness import heartbeat


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored_batch(api: Api) -> FedBatch:
    batch_id = post_batch(api, jsonl(lines_of(500)), pipeline="tiny").json()["id"]
    return BatchStore(api.store.redis, api.store.settings).get_fed(batch_id)


def with_finished(batch: FedBatch, succeeded: int) -> FedBatch:
    return dataclasses.replace(batch, counts={**batch.counts, JobState.SUCCEEDED: succeeded})


def test_the_refill_is_what_finishes_in_two_passes(api: Api) -> None:
    batch, clock = stored_batch(api), Clock()
    pace = Pace(0.5, clock)
    pace.observe([batch])
    assert pace.refill_jobs([batch], "tiny") == 0  # nothing measured yet
    for n in range(1, 6):  # 20 jobs end per 0.5 s pass: 40 per second
        clock.now += 0.5
        pace.observe([with_finished(batch, 20 * n)])
        assert pace.refill_jobs([batch], "tiny") == 20 * REFILL_PASSES


def test_slow_passes_widen_the_refill(api: Api) -> None:
    batch, clock = stored_batch(api), Clock()
    pace = Pace(0.5, clock)
    pace.observe([batch])
    for n in range(1, 10):  # the same 40 jobs per second, but a pass every 2 s
        clock.now += 2.0
        pace.observe([with_finished(batch, 80 * n)])
    assert 0.5 < pace.period_s <= 2.0
    assert pace.refill_jobs([batch], "tiny") > 20 * REFILL_PASSES


def test_each_pipeline_is_paced_by_its_own_batches(api: Api) -> None:
    # the second as if it ran on another pipeline (the test API serves only `tiny`)
    tiny, other = stored_batch(api), dataclasses.replace(stored_batch(api), pipeline="other")
    clock = Clock()
    pace = Pace(1.0, clock)
    pace.observe([tiny, other])
    clock.now += 1.0
    pace.observe([with_finished(tiny, 10), with_finished(other, 3)])
    assert pace.refill_jobs([tiny, other], "tiny") == 10 * REFILL_PASSES
    assert pace.refill_jobs([tiny, other], "other") == 3 * REFILL_PASSES
    assert pace.refill_jobs([tiny, other], None) == 13 * REFILL_PASSES
    pace.observe([])  # both ended: forgotten
    assert pace.refill_jobs([tiny, other], None) == 0


def paced_feed(make_api: ApiFactory, cap: int) -> tuple[Api, str, Clock, int]:
    """A batch fed by a feeder on a hand clock, one node of capacity 4: jobs queued first."""
    knobs: dict[str, Any] = {"batch_window": cap, "batch_window_min": 1, "batch_window_factor": 1.0}
    api = make_api(**knobs)
    heartbeat(api, "n1", ["tiny"], devices=1, max_batch=4)
    batch_id = post_batch(api, jsonl(lines_of(200)), pipeline="tiny").json()["id"]
    feed, published = feeder(api, batch_feed_interval_s=0.5, **knobs)
    clock = Clock()
    feed.pace = Pace(0.5, clock)
    feed.tick()
    first = len(published.calls)
    assert finish_queued(api, batch_id) == first
    clock.now += 0.5
    feed.tick()
    return api, batch_id, clock, first


def test_the_window_grows_with_the_finish_rate(make_api: ApiFactory) -> None:
    api, batch_id, _, first = paced_feed(make_api, cap=30)
    assert first == 4  # no rate yet: the nodes' capacity
    # 4 ended in 0.5 s: 8 per second, so 8 more for two 0.5 s passes
    assert get_batch(api, batch_id)["counts"]["queued"] == 4 + 8


def test_the_cap_still_bounds_a_paced_window(make_api: ApiFactory) -> None:
    api, batch_id, _, first = paced_feed(make_api, cap=10)
    assert first == 4
    assert get_batch(api, batch_id)["counts"]["queued"] == 10
