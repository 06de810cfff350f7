"""A batch's retry is made once: concurrent requests, the Idempotency-Key, a retry still running.

Real HTTP, Redis and object store; the feeder is driven by hand (tests/tasks/test_batches.py).
"""

from __future__ import annotations

import threading

import httpx

from kiln.storage.batch_store import BatchStore
from tests.tasks.helpers import Api
from tests.tasks.test_batches import feeder, finish_queued, get_batch, jsonl, lines_of, post_batch
from tests.tasks.test_batches_control import control


def failed_batch(api: Api, lines: int = 3) -> str:
    """A finished batch whose every line failed."""
    batch_id = str(post_batch(api, jsonl(lines_of(lines))).json()["id"])
    feed, _ = feeder(api)
    feed.tick()
    finish_queued(api, batch_id, fail=True)
    feed.tick()
    feed.tick()
    assert get_batch(api, batch_id)["status"] == "completed"
    return batch_id


def retry(api: Api, batch_id: str, key: str | None = None, **params: str) -> httpx.Response:
    headers = {**api.auth(), **({"Idempotency-Key": key} if key else {})}
    return httpx.post(
        f"{api.url}/v1/batches/{batch_id}/retry", params=params, headers=headers, timeout=60
    )


def test_ten_concurrent_retries_make_one_the_rest_are_409_naming_it(api: Api) -> None:
    parent = failed_batch(api)
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(10)

    def one() -> None:
        start.wait()
        answer = retry(api, parent)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=one) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    made = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code == 409]
    assert (len(made), len(refused)) == (1, 9), [a.text for a in answers]
    child = made[0].json()["id"]
    assert all(child in a.json()["detail"] for a in refused)
    assert get_batch(api, parent)["retries"] == [child]
    # only the winner's input is left in the store
    assert api.ctx.objects is not None
    inputs = [k for k in api.ctx.objects.list_keys("batches") if k.endswith("input.jsonl")]
    assert len(inputs) == 2, inputs  # the parent's and the one retry's


def test_the_same_idempotency_key_answers_the_same_retry(api: Api) -> None:
    parent = failed_batch(api)
    first = retry(api, parent, key="retry-1", include="failed")
    assert first.status_code == 201, first.text
    again = retry(api, parent, key="retry-1", include="failed")
    assert (again.status_code, again.json()["id"]) == (200, first.json()["id"])
    other_lines = retry(api, parent, key="retry-1", include="failed,expired")
    assert other_lines.status_code == 409
    assert first.json()["id"] in other_lines.json()["detail"]
    running = retry(api, parent, key="retry-2", include="failed")
    assert running.status_code == 409  # a new key, but the same lines are running
    assert first.json()["id"] in running.json()["detail"]
    assert len(get_batch(api, parent)["retries"]) == 1


def test_once_the_retry_has_ended_the_lines_may_be_retried_again(api: Api) -> None:
    parent = failed_batch(api, lines=2)
    child = retry(api, parent).json()["id"]
    feed, _ = feeder(api)
    feed.tick()
    finish_queued(api, child, fail=True)
    feed.tick()
    feed.tick()
    assert get_batch(api, child)["status"] == "completed"
    second = retry(api, parent)
    assert second.status_code == 201, second.text
    assert get_batch(api, parent)["retries"] == [child, second.json()["id"]]
    assert (
        BatchStore(api.store.redis, api.store.settings).get_fed(parent).retries[-1]
        == (second.json()["id"])
    )
    assert control(api, parent, "retry").status_code == 409  # the second one runs
