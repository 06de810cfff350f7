"""After a Redis restart the audit runs at once (tasks/control/audit.py `audit_after_restart`).

A private redis-server (AOF on), restarted for real. The message a consumer was taking as Redis
went down is made as kombu loses one: popped off its list, recorded nowhere; or recorded in
`unacked` by a consumer whose restore failed. Only those jobs are published again: the jobs whose
messages wait in their list, or that a live node lists as held, are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Message, Queue

from kiln.storage.job_store import JobStore
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.control.audit import audit_after_restart
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.submit import Submitter, job_queue
from tests.e2e.services import PrivateRedis
from tests.tasks.control.conftest import QUEUE, ControlFactory, lose_message


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    folder = tmp_path / "private-redis"
    folder.mkdir()
    server = PrivateRedis(folder)
    yield server
    server.stop()


@pytest.fixture
def store_redis_url(private_redis: PrivateRedis) -> str:
    """The stores, the node and the Celery app of these tests use the private Redis."""
    return private_redis.url


def restart(private_redis: PrivateRedis, *stores: JobStore) -> None:
    """Restart Redis for real; `stores` reconnect on their next command."""
    private_redis.restart(down_s=0.1)
    for store in stores:
        store.redis.connection_pool.disconnect()


def test_a_restart_audits_the_queue_at_once(
    private_redis: PrivateRedis,
    make_control: ControlFactory,
    job_store: JobStore,
    submitter: Submitter,
    app: Celery,
) -> None:
    harness = make_control()  # the deployment's audit age (300 s): no job here is that old
    request = JobRequest(pipeline="tiny", prompt="x", width=64, height=64)
    lost, waiting = (Intake(submitter, None).submit(request)[0] for _ in range(2))
    assert job_queue(lost) == QUEUE
    assert audit_after_restart(harness.ctx, [QUEUE]) == 0  # first sight of this server
    lose_message(job_store, app, lost.id)

    restart(private_redis, job_store, harness.ctx.store)
    assert audit_after_restart(harness.ctx, [QUEUE]) == 1
    assert [job_id for job_id, _, _ in harness.published] == [lost.id]
    assert waiting.id not in {job_id for job_id, _, _ in harness.published}
    assert audit_after_restart(harness.ctx, [QUEUE]) == 0  # once per restart


def strand_in_unacked(app: Celery, queue: str) -> None:
    """Take one message off `queue` as a consumer does, recorded in `unacked`, never acked.

    As a consumer whose connection broke: its channel's restore of the message failed.
    """
    connection = app.connection_for_read()
    taken: list[Message] = []
    with connection.Consumer(Queue(queue), on_message=taken.append, no_ack=False) as consumer:
        connection.drain_events(timeout=5)
        channel: Any = consumer.channel
        channel.qos.restore_at_shutdown = False
    connection.release()
    assert len(taken) == 1


def test_a_delivery_stranded_in_unacked_by_the_restart_is_published_again(
    private_redis: PrivateRedis,
    make_control: ControlFactory,
    job_store: JobStore,
    submitter: Submitter,
    app: Celery,
) -> None:
    # kombu's channel, closing after its connection broke, read a BRPOP reply in flight (the
    # message recorded in `unacked`, never handed to Celery) and could not restore it: Redis
    # was down. kombu would give it back after the visibility timeout (an hour).
    harness = make_control()
    request = JobRequest(pipeline="tiny", prompt="x", width=64, height=64)
    stranded = Intake(submitter, None).submit(request)[0]
    assert audit_after_restart(harness.ctx, [QUEUE]) == 0  # first sight of this server
    strand_in_unacked(app, QUEUE)
    held = Intake(submitter, None).submit(request)[0]
    strand_in_unacked(app, QUEUE)
    job_store.record_held("live-node", [held.id], ttl_s=60.0, incarnation="i1")

    restart(private_redis, job_store, harness.ctx.store)
    assert audit_after_restart(harness.ctx, [QUEUE]) == 1
    assert [job_id for job_id, _, _ in harness.published] == [stranded.id]  # not the held one
