"""An attempt's span links to its job's previous attempt's (tasks/node/attempt_trace.py).

Real Redis, and spans exported by OpenTelemetry's OTLP/HTTP exporter to a collector this test
runs (tests/span_collector.py); tracing is started in this process for the test and stopped.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from kiln.common.tracing import ATTEMPT_SPAN, TRACEPARENT, start_tracing, stop_tracing
from kiln.storage.attempt_traces import ATTEMPT_TRACE_FIELD, AttemptTraces
from kiln.storage.job_store import JobStore, NewJob
from kiln.tasks.node.attempt_trace import attempt_span
from tests.span_collector import SpanCollector, span_collector


@pytest.fixture
def collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[SpanCollector]:
    with span_collector() as made:
        for name, value in made.env().items():
            monkeypatch.setenv(name, value)
        assert start_tracing("kiln-node")
        try:
            yield made
        finally:
            stop_tracing()  # exports what it holds


def test_a_later_attempt_links_to_the_one_before(
    job_store: JobStore, collector: SpanCollector
) -> None:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    given = {TRACEPARENT: f"00-{trace_id}-{parent}-01"}
    record, _ = job_store.create_job(NewJob(id="job1", request={}, trace=given))
    for node in ("node-a", "node-b", "node-c"):
        with attempt_span(job_store, node, record, {}):
            pass
    stop_tracing()
    spans = collector.wait_for(lambda found: len(found) == 3)
    first, second, third = sorted(spans, key=lambda s: s.start_ns)
    assert [s.attributes["kiln.node"] for s in (first, second, third)] == [
        "node-a",
        "node-b",
        "node-c",
    ]
    assert {s.name for s in spans} == {ATTEMPT_SPAN}
    assert all((s.trace_id, s.parent_id) == (trace_id, parent) for s in spans)
    assert first.links == ()
    assert second.links == ((trace_id, first.span_id),)
    assert third.links == ((trace_id, second.span_id),)


def test_tracing_off_an_attempt_reads_and_writes_nothing(job_store: JobStore) -> None:
    record, _ = job_store.create_job(NewJob(id="job1", request={}))
    with attempt_span(job_store, "node-a", record, {}):
        pass
    assert job_store.redis.hget(job_store.keys.job("job1"), ATTEMPT_TRACE_FIELD) is None


def test_a_gone_record_is_never_made_anew(job_store: JobStore) -> None:
    traces = AttemptTraces(job_store.redis, job_store.settings)
    assert not traces.note("gone", {TRACEPARENT: f"00-{'1' * 32}-{'2' * 16}-01"})
    assert not job_store.redis.exists(job_store.keys.job("gone"))
    assert traces.previous("gone") == {}
