"""A batch's lines count against its key's queued cap as single jobs do, fed as the cap allows.

A real feeder (driven by hand, tests/tasks/test_batches.py) over real Redis and HTTP: the key's
lines wait while it is at its cap (never refused), its own POST /v1/jobs get the 429 they would
get anyway, and the state machine's per-owner counter equals the key's queued jobs throughout.
"""

from __future__ import annotations

import httpx
import pytest

from kiln.common.states import JobState
from kiln.storage.errors import QuotaExceeded
from kiln.tasks.batches.intake import batch_job_id
from tests.tasks.helpers import Api, ApiFactory, drive_to_success
from tests.tasks.test_batches import feeder, get_batch, jsonl, lines_of, post_batch, results

CAP = 2


@pytest.fixture
def capped(make_api: ApiFactory) -> Api:
    return make_api(max_queued_per_key=CAP, max_running_per_key=1)


def queued_of(api: Api, owner: str) -> tuple[int, int]:
    """(the owner's counter, the owner's jobs that are queued), as the store has them."""
    counter = int(api.store.redis.hget(api.store.keys.owner_queued, owner) or 0)
    ids = api.store.redis.zrange(api.store.keys.owner_index(owner), 0, -1)
    records = [r for r in api.store.get_many(list(ids)) if r is not None]
    return counter, sum(1 for r in records if r.state == JobState.QUEUED)


def test_a_capped_key_gets_its_lines_fed_as_its_cap_allows(capped: Api) -> None:
    api = capped
    owner = api.key_ids["alice"]
    batch_id = post_batch(api, jsonl(lines_of(7))).json()["id"]
    feed, published = feeder(api, batch_window=16, max_queued_per_key=CAP)
    feed.tick()
    assert queued_of(api, owner) == (CAP, CAP)  # two fed, five wait
    assert get_batch(api, batch_id)["counts"]["pending"] == 5
    single = httpx.post(
        f"{api.url}/v1/jobs", json={"prompt": "p", "width": 64, "height": 64}, headers=api.auth()
    )
    assert single.status_code == 429  # the batch holds the key's queue, as singles would
    feed.tick()
    assert queued_of(api, owner) == (CAP, CAP)  # nothing fed over the cap
    ids = [batch_job_id(batch_id, f"item-{n:04d}") for n in range(7)]
    done = 0
    while get_batch(api, batch_id)["status"] != "completed":
        records = api.store.get_many(ids)
        queued = [r.id for r in records if r is not None and r.state == JobState.QUEUED]
        drive_to_success(api.store, queued[0])  # one starts and ends: room for one more
        done += 1
        feed.tick()
        counter, queued_now = queued_of(api, owner)
        assert counter == queued_now <= CAP
        assert done <= 7
    assert done == 7
    assert len(published.calls) == 7
    lines = results(api, batch_id)
    assert sorted(line["custom_id"] for line in lines[:-1]) == [f"item-{n:04d}" for n in range(7)]
    assert queued_of(api, owner) == (0, 0)


def test_the_running_cap_holds_for_a_batchs_jobs(capped: Api) -> None:
    api = capped
    owner = api.key_ids["alice"]
    batch_id = post_batch(api, jsonl(lines_of(2))).json()["id"]
    feed, _ = feeder(api, max_queued_per_key=CAP)
    feed.tick()
    first, second = (batch_job_id(batch_id, f"item-{n:04d}") for n in range(2))
    held = [api.store.hold(job_id, "node-a/1", "node-a", 0)[0] for job_id in (first, second)]
    api.store.start(first, held[0], running_cap=1)
    with pytest.raises(QuotaExceeded):
        api.store.start(second, held[1], running_cap=1)
    assert api.store.get(second).state == JobState.QUEUED
    assert queued_of(api, owner) == (1, 1)
