"""After a Redis restart the audit runs at once (tasks/control/audit.py `audit_after_restart`).

A private redis-server (AOF on), restarted for real. The message a consumer was taking as Redis
went down is made as kombu loses one: popped off its list, recorded nowhere. Only that job is
published again: the jobs whose messages wait in their list are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

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

    private_redis.restart(down_s=0.1)
    for store in (job_store, harness.ctx.store):
        store.redis.connection_pool.disconnect()
    assert audit_after_restart(harness.ctx, [QUEUE]) == 1
    assert [job_id for job_id, _, _ in harness.published] == [lost.id]
    assert waiting.id not in {job_id for job_id, _, _ in harness.published}
    assert audit_after_restart(harness.ctx, [QUEUE]) == 0  # once per restart
