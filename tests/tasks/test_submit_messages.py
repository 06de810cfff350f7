"""The API's one-round-trip submit: Celery's own message pushed by the creation script.

tests/e2e/test_submit_messages.py runs such messages on a real node.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import Celery

from kiln.common.request import Lane
from kiln.storage.creation import Placement, QueueFull
from kiln.storage.job_store import JobStore, NewJob
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.app import create_app
from kiln.tasks.api.context import build_context
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.app import make_celery_app
from kiln.tasks.queue.lanes import queue_name
from kiln.tasks.queue.messages import CeleryMessages
from kiln.tasks.queue.positions import placement
from kiln.tasks.queue.submit import Submitter, celery_publisher
from tests.conftest import on_private_redis
from tests.e2e.services import PrivateRedis
from tests.tasks.helpers import ThreadServer, api_settings

TASK_ID = "0b7d3c5e-1f4a-4c2b-9d8e-6a5f4e3d2c1b"


@pytest.fixture
def messages(storage_settings: StorageSettings) -> Iterator[CeleryMessages]:
    app = make_celery_app(KilnSettings(), storage_settings)
    built = CeleryMessages(app)
    yield built
    built.close()
    app.close()


def without_tag(message: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(message)
    tag = parsed["properties"].pop("delivery_tag")
    assert tag  # kombu's: a fresh one per message
    return parsed


@pytest.mark.parametrize("lane", list(Lane))
def test_the_message_is_the_one_celery_builds(messages: CeleryMessages, lane: Lane) -> None:
    queue = queue_name(lane, "tiny")
    for job_id in ("3f2a9c0d4b5e6f708192a3b4c5d6e7f8", "a-b_C9"):
        key, message = messages.run_job(job_id, queue, TASK_ID)
        celery_key, celery_message = messages.celery_built(job_id, queue, TASK_ID)
        assert key == celery_key
        assert key.endswith(f":celery:{queue}")
        assert without_tag(message) == without_tag(celery_message)


def test_each_message_has_its_own_ids(messages: CeleryMessages) -> None:
    first = json.loads(messages.run_job("job1", "interactive.tiny")[1])
    second = json.loads(messages.run_job("job2", "interactive.tiny")[1])
    assert first["headers"]["id"] != second["headers"]["id"]
    assert first["properties"]["delivery_tag"] != second["properties"]["delivery_tag"]
    assert first["headers"]["argsrepr"] == "['job1']"


def test_an_id_the_template_cannot_take_is_built_by_celery(messages: CeleryMessages) -> None:
    odd = "job.with.dots"
    _, message = messages.run_job(odd, "bulk.tiny", TASK_ID)
    assert without_tag(message) == without_tag(messages.celery_built(odd, "bulk.tiny", TASK_ID)[1])


def test_a_separate_broker_or_task_events_keep_kombus_publish(
    storage_settings: StorageSettings,
) -> None:
    assert CeleryMessages.usable_for(KilnSettings(), storage_settings)
    other = KilnSettings(broker_url="redis://127.0.0.1:6379/9")
    assert not CeleryMessages.usable_for(other, storage_settings)
    assert not CeleryMessages.usable_for(KilnSettings(task_events=True), storage_settings)


def new_job(job_id: str, **fields: Any) -> NewJob:
    request = JobRequest(pipeline="tiny", prompt="x").to_record()
    return NewJob(
        id=job_id, request=request, lane="interactive", queue="interactive.tiny", **fields
    )


def test_the_message_is_pushed_with_a_created_job_only(
    job_store: JobStore, messages: CeleryMessages
) -> None:
    key, message = messages.run_job("job1", "interactive.tiny")
    record, created = job_store.create_job(new_job("job1"), message=(key, message))
    assert created
    assert record.published
    assert job_store.unpublished_jobs(0) == []
    again, created_again = job_store.create_job(new_job("job1"), message=(key, message))
    assert not created_again
    assert again.published
    assert job_store.redis.lrange(key, 0, -1) == [message]  # once, not again for the replay


def test_a_full_queue_writes_nothing(job_store: JobStore, messages: CeleryMessages) -> None:
    message = messages.run_job("job1", "interactive.tiny")
    job_store.create_job(new_job("job1"), max_depth=1, message=message)
    with pytest.raises(QueueFull):
        job_store.create_job(new_job("job2"), max_depth=1, message=messages.run_job("job2", "i.t"))
    assert job_store.queue_depth() == 1
    assert job_store.redis.llen(message[0]) == 1
    with pytest.raises(QueueFull):  # a replay too, as the API refused it before it looked
        job_store.create_job(new_job("job1"), max_depth=1)


def test_create_and_place_reads_what_queue_snapshot_reads(job_store: JobStore) -> None:
    place = placement("interactive", "interactive.tiny")
    for n in range(3):
        record, created, snapshot = job_store.create_and_place(new_job(f"job{n}"), place=place)
        assert created
        assert snapshot is not None
        assert snapshot.rank == n
        again = job_store.queue_snapshot(record.id, place.queue, place.other, place.rate_queues)
        assert snapshot == again.__class__(**{**again.__dict__, "now": snapshot.now})
    _, created, snapshot = job_store.create_and_place(new_job("job0"), place=place)
    assert not created
    assert snapshot is None


@on_private_redis
def test_scripts_redis_lost_are_loaded_and_a_job_is_created_once(
    job_store: JobStore, storage_settings: StorageSettings
) -> None:
    place = Placement("interactive.tiny", "bulk.tiny", ["interactive.tiny", "bulk.tiny"])
    client = redis.Redis.from_url(storage_settings.redis_url)
    try:
        client.script_flush()
        _, created, snapshot = job_store.create_and_place(new_job("job1"), place=place)
        assert created
        assert snapshot is not None
        assert snapshot.rank == 0
        job_store.create_and_place(new_job("job2"), place=place)
        client.script_flush()
        _, created, _ = job_store.create_and_place(new_job("job2"), place=place)
        assert not created
    finally:
        client.close()
    assert job_store.queue_depth() == 2


def test_submit_with_messages_keeps_submits_answers(
    job_store: JobStore, messages: CeleryMessages
) -> None:
    published: list[str] = []
    submitter = Submitter(
        job_store, api_settings(), lambda job_id, *_: published.append(job_id), messages=messages
    )
    record, created = Intake(submitter, None).submit(JobRequest(pipeline="tiny", prompt="x"))
    assert created
    assert record.published
    assert published == []
    plain = Submitter(job_store, api_settings(), lambda job_id, *_: published.append(job_id))
    other, _ = Intake(plain, None).submit(JobRequest(pipeline="tiny", prompt="y"))
    assert published == [other.id]


def test_a_submit_while_redis_is_down_is_a_503(storage_settings: StorageSettings) -> None:
    with socket.socket() as dead:  # bound, never listening: Redis connections are refused
        dead.bind(("127.0.0.1", 0))
        port = dead.getsockname()[1]
        down = storage_settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"})
        settings = api_settings(auth_enabled=False)
        ctx = build_context(settings, down)
        try:
            with ThreadServer(create_app(settings, down, context=ctx)) as server:
                body = {"pipeline": "tiny", "prompt": "x"}
                answer = httpx.post(f"{server.url}/v1/jobs", json=body, timeout=60)
        finally:
            if ctx.celery is not None:
                ctx.celery.close()
    assert answer.status_code == 503
    assert answer.json() == {"detail": "job store unavailable; retry later"}


def test_the_api_submits_across_a_redis_restart(
    storage_settings: StorageSettings, tmp_path: Path
) -> None:
    """The submit route's own (asyncio) connections: a 503 while Redis is down, then back."""
    private = PrivateRedis(tmp_path)
    storage = storage_settings.model_copy(update={"redis_url": private.url})
    settings = api_settings(auth_enabled=False)
    ctx = build_context(settings, storage)
    body = {"pipeline": "tiny", "prompt": "x"}
    try:
        with ThreadServer(create_app(settings, storage, context=ctx)) as server:
            before = httpx.post(f"{server.url}/v1/jobs", json=body, timeout=60)
            private.stop()
            down = httpx.post(f"{server.url}/v1/jobs", json=body, timeout=60)
            private.start()
            after = httpx.post(f"{server.url}/v1/jobs", json=body, timeout=60)
            assert (before.status_code, down.status_code, after.status_code) == (201, 503, 201)
            assert down.json() == {"detail": "job store unavailable; retry later"}
            store = ctx.store
            ids = [before.json()["id"], after.json()["id"]]
            assert [store.get(job_id).published for job_id in ids] == [True, True]
            assert store.queue_depth() == 2  # the refused one wrote nothing
    finally:
        if ctx.celery is not None:
            ctx.celery.close()
        private.stop()


@pytest.fixture
def lost_broker_app(storage_settings: StorageSettings) -> Iterator[Celery]:
    """A Celery app whose broker is a port nothing listens on (bound, never accepting)."""
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        down = storage_settings.model_copy(
            update={"redis_url": f"redis://127.0.0.1:{dead.getsockname()[1]}/0"}
        )
        app = make_celery_app(KilnSettings(), down)
        yield app
        app.close()


def test_without_the_broker_a_message_is_left_to_the_publish(
    job_store: JobStore, lost_broker_app: Celery
) -> None:
    unreachable = CeleryMessages(lost_broker_app)
    submitter = Submitter(job_store, api_settings(), lambda *_: None, messages=unreachable)
    try:
        assert submitter.message_for(new_job("job1")) is None
    finally:
        unreachable.close()


def test_a_publish_to_a_lost_broker_is_left_to_the_sweeper(
    job_store: JobStore, lost_broker_app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    # kombu raises a lost broker as its OperationalError, which is no OSError: a node giving a
    # start back while the primary failed over met it as a traceback, its job's message unsent
    lost_broker_app.conf.task_publish_retry = False  # the first refusal is enough to show
    submitter = Submitter(job_store, api_settings(), celery_publisher(lost_broker_app))
    record, created = Intake(submitter, None).submit(JobRequest(pipeline="tiny", prompt="x"))
    assert created
    assert not job_store.get(record.id).published
    assert job_store.unpublished_jobs(0) == [record.id]  # what the sweeper publishes again
    assert f"publishing job {record.id} failed" in caplog.text


def test_every_way_in_sends_a_jobs_message_with_its_record(
    storage_settings: StorageSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API, `kiln submit` on Redis, the control loops: each one's message in the creation.

    (Before, only the API's did; the others published with Celery after the record was written:
    two more round trips, and a moment in which the job was written without its message.)
    """
    from kiln.tasks.cli.backends import DirectBackend
    from kiln.tasks.control.context import ControlContext
    from kiln.tasks.queue.process import ProcessParts

    monkeypatch.setenv("KILN_REDIS_URL", storage_settings.redis_url)
    monkeypatch.setenv("KILN_REDIS_NAMESPACE", storage_settings.redis_namespace)
    monkeypatch.setenv("KILN_STORAGE_URL", storage_settings.storage_url)
    cli = DirectBackend()
    api = build_context(api_settings(), storage_settings)
    control = ControlContext.of(ProcessParts(api_settings(), storage_settings))
    for way_in, submitter in [
        ("cli", cli.submitter),
        ("api", api.submitter),
        ("control", control.submitter),
    ]:
        record, _ = Intake(submitter, None).submit(JobRequest(pipeline="tiny", prompt=way_in))
        assert record.published, way_in
        built = submitter.message_for(new_job(f"job-{way_in}"))  # the queue's list key with it
        assert built is not None, way_in
        queued = api.store.redis.lrange(built[0], 0, -1)
        assert any(record.id in json.loads(m)["headers"]["argsrepr"] for m in queued), way_in
    cli.close()
