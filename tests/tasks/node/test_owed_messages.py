"""Messages owed while Redis is away: a delivery or a re-publish that could not settle its job.

A Redis restart or failover cuts the node off from its store and its broker at once. A delivery
that meets that before it took its job's lease is acknowledged all the same (the task ends), and
a re-publish (a busy lease's, a start given back) fails: either way the job's only message is
gone while its record stays `queued` and marked published, which no sweeper would publish again.
The node owes such a job a message and publishes it once Redis answers, while the job is still
queued and not leased (tasks/queue/submit.py `Submitter.owe`).

On real Redis, reached by the node through a TCP proxy the test takes down.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import pytest
from kombu.exceptions import OperationalError

from kiln.storage.job_store import JobRecord, JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.node.jobs import JobRunner
from kiln.tasks.node.maintenance import announce
from kiln.tasks.node.outcomes import Delivery
from kiln.tasks.queue.submit import Submitter
from tests.e2e.services import FlakyProxy
from tests.storage.helpers import new_job
from tests.tasks.node.conftest import QUEUE, NodeFactory, NodeHarness, node_settings


@dataclass
class CutOffNode:
    """A node whose Redis connections go through `proxy`."""

    harness: NodeHarness
    proxy: FlakyProxy

    def cut_off(self) -> None:
        """Redis goes away for this node: new connections refused, open ones dropped."""
        self.proxy.down()
        self.harness.node.store.redis.connection_pool.disconnect()

    def reconnect(self) -> None:
        self.proxy.up()


@pytest.fixture
def cut_off_node(storage_settings: StorageSettings, make_node: NodeFactory) -> Iterator[CutOffNode]:
    target = urlsplit(storage_settings.redis_url)
    proxy = FlakyProxy(target.hostname or "127.0.0.1", target.port or 6379)
    proxied = storage_settings.model_copy(
        update={"redis_url": f"redis://127.0.0.1:{proxy.port}{target.path or '/0'}"}
    )
    yield CutOffNode(make_node(storage=proxied), proxy)
    proxy.up()  # make_node's teardown closes the node's connections through it
    proxy.close()


def test_a_delivery_that_meets_redis_away_owes_its_job_a_message(
    cut_off_node: CutOffNode, job_store: JobStore
) -> None:
    record, _ = job_store.create_job(new_job(queue=QUEUE))
    cut_off_node.cut_off()
    node = cut_off_node.harness.node
    outcome = JobRunner(node, record.id).run()
    submitter = node.submitter
    assert outcome.kind == Delivery.DEFERRED
    assert submitter.owed() == [record.id]
    assert submitter.publish_owed() == 0  # Redis still away: nothing is dropped
    assert submitter.owed() == [record.id]
    assert cut_off_node.harness.published == []

    cut_off_node.reconnect()
    assert submitter.publish_owed() == 1
    assert cut_off_node.harness.published == [(record.id, QUEUE, 0.0)]
    assert submitter.owed() == []
    assert submitter.publish_owed() == 0  # published once


def confirmed(store: JobStore) -> JobRecord:
    """A queued job whose message was published and confirmed (`published` set)."""
    record, _ = store.create_job(new_job(queue=QUEUE))
    store.mark_published(record.id)
    return store.get(record.id)


def test_an_owed_job_waits_while_leased_and_is_forgotten_once_finished(
    job_store: JobStore,
) -> None:
    published: list[tuple[str, float]] = []
    broker_away = True

    def publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
        del queue
        if broker_away:
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        published.append((job_id, countdown))

    submitter = Submitter(job_store, node_settings(), publish)
    held, done = confirmed(job_store), confirmed(job_store)
    assert not submitter.publish(held, countdown=30.0)  # a busy lease's, with the broker away
    assert not submitter.publish(done)
    assert submitter.owed() == sorted([held.id, done.id])

    broker_away = False
    token = job_store.acquire_lease(held.id, "other-node/1")  # its holder may start it
    job_store.cancel(done.id)
    assert submitter.publish_owed() == 0
    assert submitter.owed() == [held.id]  # still queued under a lease: it waits
    assert published == []

    job_store.release_lease(held.id, token)  # the holder let it go without starting it
    assert submitter.publish_owed() == 1
    [(job_id, countdown)] = published
    assert job_id == held.id
    assert 0.0 < countdown <= 30.0  # what is left of its countdown
    assert submitter.owed() == []


def test_a_job_owed_again_while_it_is_published_stays_owed(job_store: JobStore) -> None:
    record = confirmed(job_store)
    owe_again = True

    def publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
        del queue, countdown
        nonlocal owe_again
        if owe_again:  # another thread's re-publish of the job fails meanwhile
            owe_again = False
            submitter.owe(job_id)

    submitter = Submitter(job_store, node_settings(), publish)
    submitter.owe(record.id)
    assert submitter.publish_owed() == 1
    assert submitter.owed() == [record.id]  # that second owing is not lost
    assert submitter.publish_owed() == 1
    assert submitter.owed() == []


def test_a_creation_publish_that_fails_is_left_to_the_sweeper_not_owed(
    job_store: JobStore,
) -> None:
    def publish(job_id: str, queue: str, countdown: float = 0.0) -> None:
        raise OperationalError(f"Connection refused: {job_id} to {queue} in {countdown} s")

    submitter = Submitter(job_store, node_settings(), publish)
    record, created = job_store.create_job(new_job(queue=QUEUE))
    submitter.accepted(record, created)
    assert not submitter.publish(record)  # a resumed or fed job's first publish, say
    assert submitter.owed() == []  # its record is unconfirmed: the sweeper's
    assert record.id in job_store.unpublished_jobs(older_than_s=-1.0)


def test_a_node_lists_the_jobs_it_owes_with_its_held_messages(
    make_node: NodeFactory, job_store: JobStore
) -> None:
    # if it dies owing them, the sweeper that claims its lapse publishes them again
    harness = make_node()
    record = confirmed(job_store)
    harness.node.submitter.owe(record.id)
    announce(harness.node)  # the heartbeat's start: one heartbeat and one held list now
    assert record.id in job_store.held_jobs()
