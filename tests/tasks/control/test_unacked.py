"""The messages a dead node held but never listed (tasks/control/unacked.py).

Real Redis and kombu's real Redis transport: a message is taken from its queue by a kombu
consumer and left unacknowledged, as a worker killed before its strategy ran leaves it.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery
from kombu import Queue

from kiln.storage.job_store import JobStore
from kiln.storage.nodes import LapsedHolder
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.control.unacked import CLOCK_SLACK_S, lapse_windows, orphaned_jobs
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.kombu_redis import run_job_id, unacked_keys
from kiln.tasks.queue.submit import Submitter, job_queue

LAPSE_TTL_S = 0.05


def submit(submitter: Submitter) -> str:
    record, _ = Intake(submitter, None).submit(
        JobRequest(pipeline="tiny", prompt="x", width=64, height=64)
    )
    return record.id


def take_without_ack(app: Celery, queue: str) -> None:
    """Take one message from `queue` as a worker does; leave it as a killed worker would."""
    taken = []
    connection = app.connection_for_read()
    with connection.Consumer(Queue(queue), callbacks=[lambda _, m: taken.append(m)]) as consumer:
        connection.drain_events(timeout=5)
        channel: Any = consumer.channel  # kombu's virtual channel, with its ack emulation
        channel.qos.restore_at_shutdown = False  # killed: nothing restores it
    connection.release()
    assert len(taken) == 1


def lapse(store: JobStore, node_id: str, job_ids: list[str]) -> None:
    """`node_id` listed `job_ids` and died: its heartbeat deadline passes."""
    store.record_held(node_id, job_ids, ttl_s=LAPSE_TTL_S)
    time.sleep(2 * LAPSE_TTL_S)


def test_a_delivery_the_dead_node_never_listed_is_found_once(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    job_store.record_held("node-dead", [], ttl_s=60)  # its heartbeat, before the delivery
    job_id = submit(submitter)
    take_without_ack(app, job_queue(job_store.get(job_id)))
    lapse(job_store, "node-dead", [])
    assert orphaned_jobs(job_store, app) == [job_id]
    assert orphaned_jobs(job_store, app) == []  # the lapse is claimed once


def test_without_a_lapse_no_delivery_is_read(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    job_store.record_held("node-live", [], ttl_s=60)
    job_id = submit(submitter)
    take_without_ack(app, job_queue(job_store.get(job_id)))
    assert orphaned_jobs(job_store, app) == []


def test_deliveries_a_live_node_answers_for_are_left_alone(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    listed, leased, finished = submit(submitter), submit(submitter), submit(submitter)
    for job_id in (listed, leased, finished):
        take_without_ack(app, job_queue(job_store.get(job_id)))
    job_store.record_held("node-live", [listed], ttl_s=60)  # a countdown it waits on
    job_store.acquire_lease(leased, "node-live/1")  # about to start it
    job_store.cancel(finished)
    lapse(job_store, "node-dead", ["job-it-listed"])
    assert orphaned_jobs(job_store, app) == ["job-it-listed"]


def test_run_job_id_reads_kiln_messages_only(
    job_store: JobStore, app: Celery, submitter: Submitter
) -> None:
    job_id = submit(submitter)
    take_without_ack(app, job_queue(job_store.get(job_id)))
    app.send_task("kiln.some_other_task", args=["not-a-job"], queue="elsewhere")
    take_without_ack(app, "elsewhere")
    values = job_store.redis.hvals(unacked_keys(app)[1])
    assert sorted(map(str, map(run_job_id, values))) == sorted([job_id, "None"])
    assert run_job_id("not json") is None
    assert run_job_id('[{"headers": {"task": "kiln.run_job"}}, "", ""]') is None


def test_lapse_windows_widen_and_merge() -> None:
    holders = [
        LapsedHolder("a", 100_000, 106_000, []),
        LapsedHolder("b", 110_000, 116_000, []),  # overlaps a's once widened
        LapsedHolder("c", 500_000, 506_000, []),
    ]
    slack = CLOCK_SLACK_S
    assert lapse_windows(holders) == [
        (100 - slack, 116 + slack),
        (500 - slack, 506 + slack),
    ]
