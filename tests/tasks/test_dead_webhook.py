"""The `job.dead` webhook: sent, signed, by a real webhook worker when a job fails for good."""

from __future__ import annotations

from kiln.tasks.webhooks.enqueue import enqueue_webhook_events
from tests.tasks.helpers import Receiver, drive_to_success, start_job
from tests.tasks.test_webhooks import WebhookWorld, verify, webhook_job
from tests.tasks.test_webhooks import world as world  # the fixture: a real webhook worker
from tests.waiting import wait_until

BROKE = {
    "type": "WorkerGroupDied",
    "message": "the worker group died",
    "retryable": False,
    "poison": "group_broken_twice",
}


def test_a_failure_for_good_sends_job_dead_signed_beside_job_completed(
    world: WebhookWorld,
) -> None:
    receiver = Receiver()
    try:
        store = world.store
        job_id = webhook_job(store, receiver.url, ["completed", "dead"])
        store.fail(job_id, start_job(store, job_id), BROKE)
        assert enqueue_webhook_events(store, job_id, "failed", app=world.celery)
        hits = receiver.wait_for(2, timeout=120)
        by_type = {verify(hit)["type"]: hit for hit in hits}  # each checked against its signature
        assert sorted(by_type) == ["job.completed", "job.dead"]
        dead = verify(by_type["job.dead"])
        assert by_type["job.dead"].headers["webhook-id"] == f"msg_{job_id}_dead"
        assert dead["data"]["id"] == job_id
        assert dead["data"]["status"] == "failed"
        assert dead["data"]["error"]["poison"] == "group_broken_twice"
    finally:
        receiver.close()


def test_job_dead_goes_only_to_its_subscribers_and_only_for_a_failure(
    world: WebhookWorld,
) -> None:
    receiver = Receiver()
    try:
        store = world.store
        unsubscribed = webhook_job(store, receiver.url, ["completed"])
        store.fail(unsubscribed, None, BROKE)
        succeeded = webhook_job(store, receiver.url, ["completed", "dead"])
        drive_to_success(store, succeeded)
        for job_id, state in ((unsubscribed, "failed"), (succeeded, "succeeded")):
            enqueue_webhook_events(store, job_id, state, app=world.celery)
        hits = receiver.wait_for(2, timeout=120)
        # both completions, and nothing else once the worker has had the time to send more
        wait_until(
            lambda: len(store.webhook_attempts(unsubscribed) + store.webhook_attempts(succeeded)),
            lambda n: n >= 2,
            timeout_s=60,
            what="both completions recorded",
        )
        assert sorted(verify(hit)["type"] for hit in hits) == ["job.completed", "job.completed"]
        assert all(hit.headers["webhook-id"].endswith("_completed") for hit in receiver.hits)
    finally:
        receiver.close()
