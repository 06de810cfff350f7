"""A job's W3C trace context, carried from its entrance to its node (kiln/common/tracing.py).

Real Redis and real Celery messages: the context a caller gives is stored on the job's record,
pushed in its `run_job` message's headers (the template Kiln fills, or Celery's own build), and
read back from the message as Celery's worker hands it to the task.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context
from celery.worker.request import Request
from kombu import Message, Queue

from kiln.common.tracing import (
    TRACEPARENT,
    TRACESTATE,
    given_carrier,
    message_carrier,
    trace_id_of,
    tracing_asked,
    valid_carrier,
)
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from kiln.tasks.api.app import create_app
from kiln.tasks.batches.intake import item_line, parse_item
from kiln.tasks.client.client import KilnClient
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.app import RUN_JOB_TASK, make_celery_app
from kiln.tasks.queue.messages import CeleryMessages
from kiln.tasks.queue.submit import Submitter, celery_publisher
from kiln.tasks.webhooks.batch_hooks import BatchDelivery, deliver_batch_once
from tests.tasks.helpers import Api, Receiver, ThreadServer, api_settings

QUEUE = "interactive.tiny"
TASK_ID = "0b7d3c5e-1f4a-4c2b-9d8e-6a5f4e3d2c1b"


def traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


@pytest.fixture
def app(storage_settings: StorageSettings) -> Iterator[Celery]:
    made = make_celery_app(KilnSettings(), storage_settings)

    @made.task(name=RUN_JOB_TASK, shared=False)
    def run_job(job_id: str) -> None:  # the node's task, as its worker finds it by name
        del job_id

    yield made
    made.close()


@pytest.fixture
def messages(app: Celery) -> Iterator[CeleryMessages]:
    built = CeleryMessages(app)
    yield built
    built.close()


def without_tag(message: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(message)
    assert parsed["properties"].pop("delivery_tag")
    return parsed


def delivered(app: Celery) -> Context:
    """The next message of QUEUE as the worker hands it to the task (its `self.request`)."""
    taken: list[Message] = []
    connection = app.connection_for_read()
    with connection.Consumer(Queue(QUEUE), on_message=taken.append, no_ack=True):
        connection.drain_events(timeout=5)
    connection.release()
    (message,) = taken
    return Context(Request(message, app=app).request_dict)


def test_tracing_is_off_unless_the_otel_variables_ask() -> None:
    assert not tracing_asked({})
    assert not tracing_asked({"OTEL_TRACES_EXPORTER": "none"})
    assert tracing_asked({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing_asked({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing_asked({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    off = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}
    assert not tracing_asked(off)


def test_a_carrier_is_w3c_or_nothing() -> None:
    given = traceparent()
    assert given_carrier(given) == {TRACEPARENT: given}
    assert given_carrier(given, "a=1") == {TRACEPARENT: given, TRACESTATE: "a=1"}
    assert trace_id_of({TRACEPARENT: given}) == given.split("-")[1]
    for bad in ("", "00-xyz", f"00-{'0' * 32}-{'0' * 16}-01", given.upper() + "-"):
        assert given_carrier(bad) == {}
    assert valid_carrier({TRACESTATE: "a=1"}) == {}  # a tracestate alone names no trace


def test_a_traced_message_is_the_one_celery_builds_with_the_header(
    messages: CeleryMessages,
) -> None:
    given = traceparent()
    for job_id in ("3f2a9c0d4b5e6f708192a3b4c5d6e7f8", "a-b_C9"):
        key, message = messages.run_job(job_id, QUEUE, TASK_ID, trace={TRACEPARENT: given})
        built_key, built = messages.celery_built(
            job_id, QUEUE, TASK_ID, headers={TRACEPARENT: given}
        )
        assert key == built_key
        assert without_tag(message) == without_tag(built)
        assert json.loads(message)["headers"][TRACEPARENT] == given
    # an untraced job's message, from its own template, has no such header
    plain = json.loads(messages.run_job("job2", QUEUE, TASK_ID)[1])
    assert TRACEPARENT not in plain["headers"]
    # a tracestate too: Celery builds it, both headers in
    both = {TRACEPARENT: given, TRACESTATE: "vendor=1,other=2"}
    headers = json.loads(messages.run_job("job3", QUEUE, TASK_ID, trace=both)[1])["headers"]
    assert (headers[TRACEPARENT], headers[TRACESTATE]) == (given, "vendor=1,other=2")


@pytest.mark.parametrize("tracestate", [None, "vendor=kiln"])
def test_the_context_given_at_submit_reaches_the_node_in_the_message_headers(
    app: Celery,
    messages: CeleryMessages,
    job_store: JobStore,
    tracestate: str | None,
) -> None:
    submitter = Submitter(job_store, api_settings(), lambda *_: None, messages=messages)
    intake = Intake(submitter, None)
    given = given_carrier(traceparent(), tracestate)
    record, created = intake.submit(JobRequest(pipeline="tiny", prompt="x"), trace=given)
    assert created
    assert record.published  # its message went with the record
    assert job_store.get(record.id).trace == given  # stored on the job
    request = delivered(app)
    assert request.args == [record.id]
    assert message_carrier(request) == given  # what the node's delivery continues

    untraced, _ = intake.submit(JobRequest(pipeline="tiny", prompt="y"))
    assert job_store.get(untraced.id).trace == {}
    assert message_carrier(delivered(app)) == {}


def test_a_batch_line_keeps_its_own_trace_context() -> None:
    spec = JobSpec.of(JobRequest(pipeline="tiny", prompt="x", seed=1))
    given = given_carrier(traceparent(), "a=1")
    item = parse_item(item_line(3, "line-3", spec, given))
    assert (item.line, item.custom_id, item.spec, item.trace) == (3, "line-3", spec, given)
    assert b'"t"' not in item_line(3, "line-3", spec)  # none: the line is as before
    assert parse_item(item_line(3, "line-3", spec)).trace == {}


def test_the_python_client_sends_the_context_the_api_stores(
    storage_settings: StorageSettings, job_store: JobStore
) -> None:
    app = create_app(api_settings(auth_enabled=False), storage_settings)
    given = given_carrier(traceparent(), "vendor=client")
    with ThreadServer(app) as api, KilnClient(api.url) as client:
        traced = client.submit(
            JobRequest(pipeline="tiny", prompt="x"),
            traceparent=given[TRACEPARENT],
            tracestate=given[TRACESTATE],
        )
        plain = client.submit(JobRequest(pipeline="tiny", prompt="y"))
        broken = client.submit(JobRequest(pipeline="tiny", prompt="z"), traceparent="00-bad")
    assert job_store.get(traced.id).trace == given
    assert job_store.get(plain.id).trace == {}  # tracing off here: nothing started
    assert job_store.get(broken.id).trace == {}  # not W3C: dropped, as the spec says


def test_the_console_exporter_prints_a_process_spans() -> None:
    parent = f"00-{'a' * 32}-{'b' * 16}-01"
    script = (
        "from kiln.common.tracing import ADMISSION_SPAN, span, start_tracing\n"
        "assert start_tracing('kiln-probe')\n"
        f"with span(ADMISSION_SPAN, {{'traceparent': '{parent}'}}):\n"
        "    pass\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)  # the SDK's console exporter: one JSON object per span
    assert printed["name"] == "kiln.admission"
    assert printed["context"]["trace_id"] == "0x" + "a" * 32
    assert printed["parent_id"] == "0x" + "b" * 16
    assert printed["resource"]["attributes"]["service.name"] == "kiln-probe"
    # and off by default: the same process prints nothing
    env.pop("OTEL_TRACES_EXPORTER")
    quiet = subprocess.run(
        [sys.executable, "-c", script.replace("assert start_tracing", "assert not start_tracing")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == ""


def test_a_batch_webhook_carries_the_batch_trace_context(api: Api, receiver: Receiver) -> None:
    given = given_carrier(traceparent(), "vendor=batch")
    delivery = BatchDelivery(
        "b1", "batch.completed", "msg_batch_b1_completed", receiver.url, "{}", trace=given
    )
    assert deliver_batch_once(api.settings, delivery) is None  # delivered: no retry
    untraced = BatchDelivery("b2", "batch.completed", "msg_batch_b2_completed", receiver.url, "{}")
    assert deliver_batch_once(api.settings, untraced) is None
    traced_hit, plain_hit = receiver.wait_for(2)
    headers = {k.lower(): v for k, v in traced_hit.headers.items()}
    # tracing off in this process: the batch's context goes out as it was stored
    assert (headers[TRACEPARENT], headers[TRACESTATE]) == (given[TRACEPARENT], "vendor=batch")
    assert TRACEPARENT not in {k.lower() for k in plain_hit.headers}


def test_a_job_published_by_celery_itself_carries_its_context_too(
    app: Celery, job_store: JobStore
) -> None:
    # no message with the record (another broker, task events on): kombu publishes after it
    submitter = Submitter(job_store, api_settings(), celery_publisher(app))
    given = given_carrier(traceparent(), "vendor=kombu")
    record, _ = Intake(submitter, None).submit(JobRequest(pipeline="tiny", prompt="x"), trace=given)
    assert job_store.get(record.id).published
    assert message_carrier(delivered(app)) == given
    submitter.publish(job_store.get(record.id))  # the sweeper's re-publish: the same headers
    assert message_carrier(delivered(app)) == given
