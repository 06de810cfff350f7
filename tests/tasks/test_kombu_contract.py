"""What Kiln relies on inside kombu's Redis transport (tasks/queue/kombu_redis.py) still holds.

pyproject.toml bounds kombu's and celery's versions; before widening them, run this file on the
new version. Real Redis, a real Celery app publishing, kombu's own consumer taking the message
without an ack as a worker with `acks_late` does: each test fails if kombu changes where it
lists messages, what it pushes, how it records an unacknowledged delivery, or when.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Message, Queue

from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.app import RUN_JOB_TASK, make_celery_app
from kiln.tasks.queue.kombu_redis import (
    PushCapture,
    SentinelTransport,
    Transport,
    listed_run_job_id,
    queue_list_keys,
    run_job_id,
    unacked_keys,
)

QUEUE = "interactive.tiny"
JOB_ID = "3f2a9c0d4b5e6f708192a3b4c5d6e7f8"
TASK_ID = "0b7d3c5e-1f4a-4c2b-9d8e-6a5f4e3d2c1b"


@pytest.fixture
def app(storage_settings: StorageSettings) -> Iterator[Celery]:
    celery_app = make_celery_app(KilnSettings(), storage_settings)
    yield celery_app
    celery_app.close()


def publish(app: Celery, priority: int | None = None) -> None:
    """`run_job(JOB_ID)` published the ordinary way: kombu pushes it."""
    app.send_task(RUN_JOB_TASK, args=[JOB_ID], task_id=TASK_ID, queue=QUEUE, priority=priority)


def without_tag(envelope: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(envelope)
    assert parsed["properties"].pop("delivery_tag")  # a fresh one per message
    return parsed


def tag_of(message: Message) -> str:
    """The delivery tag kombu gave `message` (the key of its `unacked` entry)."""
    assert message.delivery_tag is not None
    return str(message.delivery_tag)


def take_without_ack(app: Celery, on_message: Any = None) -> Message:
    """Take one message from QUEUE as a worker with acks_late does; never ack it."""
    taken: list[Message] = []

    def received(message: Message) -> None:
        if on_message is not None:
            on_message(message)
        taken.append(message)

    connection = app.connection_for_read()
    # Celery's worker sets `on_message` too (celery/worker/loops.py): its task strategy is called
    # from there, so it sees what this callback sees
    with connection.Consumer(Queue(QUEUE), on_message=received, no_ack=False) as consumer:
        connection.drain_events(timeout=5)
        channel: Any = consumer.channel
        channel.qos.restore_at_shutdown = False  # as a killed worker: nothing restores it
    connection.release()
    assert len(taken) == 1
    return taken[0]


@pytest.mark.parametrize("priority", [None, 6])
def test_the_captured_push_is_what_kombu_pushes(
    app: Celery, job_store: JobStore, priority: int | None
) -> None:
    capture = PushCapture(app)
    app.send_task(
        RUN_JOB_TASK,
        args=[JOB_ID],
        task_id=TASK_ID,
        queue=QUEUE,
        priority=priority,
        producer=capture.producer(),
    )
    ((key, envelope),) = capture.take()
    capture.close()
    assert capture.take() == []

    publish(app, priority)
    pushed = {k: job_store.redis.lrange(k, 0, -1) for k in queue_list_keys(app, QUEUE)}
    assert {k: len(v) for k, v in pushed.items() if v} == {key: 1}  # the same list, once
    assert without_tag(envelope) == without_tag(pushed[key][0])
    assert listed_run_job_id(envelope) == listed_run_job_id(pushed[key][0]) == JOB_ID


def test_a_captured_push_is_consumed_as_kombu_own(app: Celery, job_store: JobStore) -> None:
    capture = PushCapture(app)
    app.send_task(
        RUN_JOB_TASK, args=[JOB_ID], task_id=TASK_ID, queue=QUEUE, producer=capture.producer()
    )
    ((key, envelope),) = capture.take()
    capture.close()
    job_store.redis.lpush(key, envelope)  # as the creation script does
    message = take_without_ack(app)
    assert message.headers["id"] == TASK_ID
    assert message.decode()[0] == [JOB_ID]


def test_the_unacked_layout_decodes(app: Celery, job_store: JobStore) -> None:
    publish(app)
    before_s = time.time()
    message = take_without_ack(app)
    after_s = time.time()
    index_key, hash_key = unacked_keys(app)
    deliveries = job_store.redis.hgetall(hash_key)
    tag = tag_of(message)
    assert list(deliveries) == [tag]
    assert run_job_id(deliveries[tag]) == JOB_ID
    # the index: tag -> the consumer's time in seconds, what a lapse's window is read by
    recorded_s = job_store.redis.zscore(index_key, tag)
    assert recorded_s is not None
    assert before_s <= recorded_s <= after_s
    window = job_store.unacked_deliveries(index_key, hash_key, before_s, after_s, 10)
    assert list(map(run_job_id, window)) == [JOB_ID]


def test_a_delivery_is_recorded_before_the_consumer_sees_it(
    app: Celery, job_store: JobStore
) -> None:
    publish(app)
    index_key, hash_key = unacked_keys(app)
    seen: dict[str, Any] = {}

    def strategy(message: Message) -> None:
        # what Redis holds when Celery's strategy (tasks/node/held.py) gets the message
        seen["unacked"] = job_store.redis.hget(hash_key, tag_of(message))
        seen["indexed"] = job_store.redis.zscore(index_key, tag_of(message))
        seen["listed"] = sum(job_store.redis.llen(k) for k in queue_list_keys(app, QUEUE))

    take_without_ack(app, strategy)
    assert seen["listed"] == 0  # popped from its list ...
    assert run_job_id(seen["unacked"]) == JOB_ID  # ... and already recorded
    assert seen["indexed"] is not None


@pytest.mark.parametrize(
    ("broker", "transport"),
    [
        ("redis://127.0.0.1:6379/0", Transport),
        ("rediss://127.0.0.1:6380/0", Transport),
        ("sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", SentinelTransport),
    ],
)
def test_every_redis_broker_gets_the_channel_that_survives_a_broken_connection(
    storage_settings: StorageSettings, broker: str, transport: type
) -> None:
    # item 5's transports, under kombu's own scheme names: what kombu derives from the name holds
    app = make_celery_app(KilnSettings(broker_url=broker), storage_settings)
    connection = app.connection_for_read()
    assert type(connection.transport) is transport
    if broker.startswith("rediss://"):
        assert connection.ssl  # kombu turns TLS on for the `rediss` name
    connection.maybe_switch_next()  # a `;`-list's next URL, as after a failed reconnect
    assert type(connection.transport) is transport
    connection.release()
    app.close()
