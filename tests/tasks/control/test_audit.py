"""The audit of queued jobs whose message is lost (tasks/control/audit.py, storage/audit.py).

Real Redis and kombu's real Redis transport. A lost message is made as kombu loses one: popped
off its queue list (what BRPOP does) and never recorded as unacknowledged. The age is 0 s (every
job queued before the pass is old) or an hour (every job is young): no test waits on a clock.
"""

from __future__ import annotations

import time

from celery import Celery

from kiln.storage.job_store import JobStore
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.control.audit import lost_jobs
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.app import RUN_JOB_TASK
from kiln.tasks.queue.kombu_redis import queue_list_keys, unacked_keys
from kiln.tasks.queue.submit import Submitter, job_queue
from tests.tasks.control.conftest import QUEUE, lose_message
from tests.tasks.helpers import write_many

REQUEST = JobRequest(pipeline="tiny", prompt="x", width=64, height=64)
OLD = 0.0  # every job queued before the pass began is old
YOUNG = 3600.0  # no job is


def submit(submitter: Submitter) -> str:
    record, _ = Intake(submitter, None).submit(REQUEST)
    assert job_queue(record) == QUEUE
    return record.id


def broker_down(job_id: str, queue: str, countdown: float = 0.0) -> None:  # noqa: ARG001
    raise OSError("broker unreachable")


def test_a_published_job_whose_message_is_nowhere_is_found(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    lost, waiting = submit(submitter), submit(submitter)
    lose_message(job_store, app, lost)
    assert job_store.get(lost).published
    assert lost_jobs(job_store, app, [QUEUE], OLD) == [lost]
    assert waiting not in lost_jobs(job_store, app, [QUEUE], OLD)


def test_a_job_whose_message_is_accounted_for_is_not(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    unacked, held, lapsed_held, leased = (submit(submitter) for _ in range(4))
    for job_id in (unacked, held, lapsed_held, leased):
        message = lose_message(job_store, app, job_id)
        if job_id == unacked:  # kombu's record of a delivery: [message, exchange, routing key]
            _, hash_key = unacked_keys(app)
            job_store.redis.hset(hash_key, "tag-1", f'[{message}, "", "{QUEUE}"]')
    job_store.record_held("node-live", [held], ttl_s=60)
    job_store.record_held("node-dead", [lapsed_held], ttl_s=0.001)  # the sweeper's to claim
    job_store.acquire_lease(leased, "node-live/1")
    assert lost_jobs(job_store, app, [QUEUE], OLD) == []


def test_a_young_job_and_an_unconfirmed_publish_are_left_alone(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    young = submit(submitter)
    lose_message(job_store, app, young)
    assert lost_jobs(job_store, app, [QUEUE], YOUNG) == []
    # its publish failed, so it is not marked published: the sweeper's, not the audit's
    failing = Submitter(job_store, KilnSettings(pipelines=["tiny"]), broker_down)
    unconfirmed, _ = Intake(failing, None).submit(REQUEST)
    assert not job_store.get(unconfirmed.id).published
    assert lost_jobs(job_store, app, [QUEUE], OLD) == [young]


def test_a_message_in_a_priority_list_is_seen(job_store: JobStore, app: Celery) -> None:
    # created without a message (a publish that does nothing) and marked published
    quiet = Submitter(job_store, KilnSettings(pipelines=["tiny"]), lambda *_: None)
    record, _ = Intake(quiet, None).submit(REQUEST)
    assert job_store.get(record.id).published
    app.send_task(RUN_JOB_TASK, args=[record.id], queue=QUEUE, priority=9)
    lengths = [job_store.redis.llen(key) for key in queue_list_keys(app, QUEUE)]
    assert lengths[0] == 0
    assert sum(lengths) == 1  # kombu put it in a priority list
    assert lost_jobs(job_store, app, [QUEUE], OLD) == []


def test_lists_indexes_and_unacked_are_read_past_one_page(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    ids = write_many(Intake(submitter, None), [REQUEST] * 2500)
    lost = ids[1700]
    lose_message(job_store, app, lost)
    assert lost_jobs(job_store, app, [QUEUE], OLD) == [lost]
    # 1,500 of the others delivered and unacknowledged: kombu's hash, scanned in pages
    _, hash_key = unacked_keys(app)
    key = queue_list_keys(app, QUEUE)[0]
    for tag in range(1500):
        message = job_store.redis.rpop(key)
        job_store.redis.hset(hash_key, f"tag-{tag}", f'[{message}, "", "{QUEUE}"]')
    assert job_store.redis.hlen(hash_key) == 1500
    assert lost_jobs(job_store, app, [QUEUE], OLD) == [lost]


def test_the_record_is_read_again_before_it_is_published(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    lost = submit(submitter)
    lose_message(job_store, app, lost)
    job_store.cancel(lost)  # no longer queued
    assert lost_jobs(job_store, app, [QUEUE], OLD) == []


def test_one_node_per_queue_claims_each_interval(job_store: JobStore) -> None:
    due = job_store.claim_audits(["interactive.a", "bulk.a"], 3600)
    assert due.queues == ["interactive.a", "bulk.a"]
    assert due.lapse_deadline_s == 0  # no node lapsed
    assert job_store.claim_audits(["interactive.a", "bulk.b"], 3600).queues == ["bulk.b"]
    assert job_store.claim_audits(["interactive.a"], 0).queues == ["interactive.a"]  # interval


def test_a_claimed_lapse_makes_every_queue_due_once(job_store: JobStore) -> None:
    queues = ["interactive.a", "bulk.a"]
    assert job_store.claim_audits(queues, 3600).queues == queues
    assert job_store.claim_audits(queues, 3600).queues == []
    job_store.record_held("node-dead", [], ttl_s=0.001)
    time.sleep(0.01)
    assert job_store.claim_audits(queues, 3600).queues == []  # lapsed, but no sweeper claimed it
    (holder,) = job_store.claim_lapsed_holders().holders
    time.sleep(0.002)  # the claims are compared in ms
    due = job_store.claim_audits(queues, 3600)
    assert due.queues == queues
    assert due.lapse_deadline_s == holder.deadline_ms / 1000
    assert job_store.claim_audits(queues, 3600).queues == []  # once per lapse


def test_after_a_lapse_a_job_queued_before_the_death_is_a_suspect_at_once(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    lost = submit(submitter)
    lose_message(job_store, app, lost)  # popped by a node killed before kombu recorded it
    assert lost_jobs(job_store, app, [QUEUE], YOUNG) == []  # the age alone: not yet
    now = job_store.redis_now()
    long_ago = now - YOUNG / 2  # a lapse before the job was queued cannot have lost it
    assert lost_jobs(job_store, app, [QUEUE], YOUNG, lapse_deadline_s=long_ago) == []
    assert lost_jobs(job_store, app, [QUEUE], YOUNG, lapse_deadline_s=now) == [lost]
