"""Traces from producer to rank, across real processes (kiln/common/tracing.py).

A real `kiln api` (uvicorn), a real `kiln worker` (the sleepy pipeline, its rank 0 a process of
its own), a webhooks-only `kiln worker` and a webhook receiver run against one cluster; every
Kiln process exports its spans with OpenTelemetry's OTLP/HTTP exporter to a collector the test
runs (tests/span_collector.py). One submitted job is one connected trace, its spans from four
processes; a batch's line jobs are a trace each, linked to the batch's span.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kiln.common.media import BATCH_INPUT_CONTENT_TYPE
from kiln.common.states import JobState
from kiln.common.tracing import (
    ADMISSION_SPAN,
    ATTEMPT_SPAN,
    BATCH_SPAN,
    DECODE_SPAN,
    DENOISE_SPAN,
    ENCODE_SPAN,
    QUEUE_WAIT_SPAN,
    STEP_EVENT,
    TEXT_ENCODING_SPAN,
    UPLOAD_SPAN,
    WEBHOOK_SPAN,
)
from tests.e2e.cluster import SLEEPY, Cluster
from tests.e2e.pipelines import POISON_PROMPT
from tests.e2e.test_observability import ApiProcess, start_api
from tests.span_collector import CollectedSpan, SpanCollector, span_collector
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

STEPS = 3
# the spans of one job's trace, by the process that makes them
API_SPANS = {ADMISSION_SPAN}
NODE_SPANS = {QUEUE_WAIT_SPAN, ATTEMPT_SPAN, ENCODE_SPAN, UPLOAD_SPAN}
RANK_SPANS = {DENOISE_SPAN, TEXT_ENCODING_SPAN, DECODE_SPAN}
WEBHOOK_SPANS = {WEBHOOK_SPAN}
JOB_SPANS = API_SPANS | NODE_SPANS | RANK_SPANS | WEBHOOK_SPANS


@dataclass
class Receiver:
    """A webhook endpoint: the headers of every delivery it answered 200."""

    url: str
    deliveries: list[dict[str, str]] = field(default_factory=list)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            found.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield Receiver(f"http://127.0.0.1:{server.server_address[1]}/hook", found)
    server.shutdown()
    server.server_close()


@dataclass
class TracedStack:
    cluster: Cluster
    api: ApiProcess
    collector: SpanCollector


@pytest.fixture(scope="module")
def stack(module_cluster_factory: Callable[..., Cluster]) -> Iterator[TracedStack]:
    with span_collector() as collector:
        secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
        cluster = module_cluster_factory(
            **collector.env(),
            KILN_WEBHOOK_SECRET=secret,
            KILN_WEBHOOK_ALLOW_HTTP="true",
            KILN_WEBHOOK_ALLOW_HOSTS="127.0.0.1",
            KILN_TEST_STEP_SECONDS="0.01",
        )
        cluster.start_worker(f"sleepy={SLEEPY}")
        cluster.start_worker(extra_args=["--webhooks"], wait=False)  # webhooks only
        api = start_api(cluster)
        try:
            yield TracedStack(cluster, api, collector)
        finally:
            api.stop()


def by_name(spans: list[CollectedSpan]) -> dict[str, list[CollectedSpan]]:
    named: dict[str, list[CollectedSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def has_all(trace_id: str, names: set[str]) -> Callable[[list[CollectedSpan]], bool]:
    return lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id}


def test_one_job_is_one_trace_across_four_processes(stack: TracedStack, receiver: Receiver) -> None:
    producer_trace, producer_span = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = f"00-{producer_trace}-{producer_span}-01"
    response = httpx.post(
        f"{stack.api.url}/v1/jobs",
        json={
            "prompt": "traced",
            "pipeline": "sleepy",
            "steps": STEPS,
            "width": 64,
            "height": 64,
            "webhook": {"url": receiver.url, "events": ["completed"]},
        },
        headers={"traceparent": traceparent, "tracestate": "vendor=kiln-test"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert stack.cluster.wait_for(job_id).state == JobState.SUCCEEDED
    record = stack.cluster.store.get(job_id)
    assert record.trace["traceparent"].split("-")[1] == producer_trace
    assert record.trace["tracestate"] == "vendor=kiln-test"

    stack.collector.wait_for(has_all(producer_trace, JOB_SPANS))
    named = by_name(stack.collector.spans(producer_trace))
    (admission,) = named[ADMISSION_SPAN]
    (attempt,) = named[ATTEMPT_SPAN]
    (denoise,) = named[DENOISE_SPAN]
    # parent/child links: producer -> admission -> (queue wait, attempt, webhook attempts);
    # attempt -> (encode, upload, denoise); denoise -> (text encoding, decode)
    assert admission.parent_id == producer_span
    assert admission.attributes["kiln.job_id"] == job_id
    parents = {
        QUEUE_WAIT_SPAN: admission,
        ATTEMPT_SPAN: admission,
        WEBHOOK_SPAN: admission,
        ENCODE_SPAN: attempt,
        UPLOAD_SPAN: attempt,
        DENOISE_SPAN: attempt,
        TEXT_ENCODING_SPAN: denoise,
        DECODE_SPAN: denoise,
    }
    for name, parent in parents.items():
        for span in named[name]:
            assert span.parent_id == parent.span_id, (name, span, parent)
    assert [e for e, _ in denoise.events].count(STEP_EVENT) == STEPS
    assert [facts["step"] for _, facts in denoise.events] == list(range(1, STEPS + 1))
    # every span's parent is in the trace (or is the producer's): one connected trace
    ids = {s.span_id for s in stack.collector.spans(producer_trace)} | {producer_span}
    assert all(s.parent_id in ids for s in stack.collector.spans(producer_trace))
    # four processes, each its own service: the API, the node, its rank 0, the webhooks worker
    services = {s.service: s.pid for s in stack.collector.spans(producer_trace)}
    assert set(services) == {"kiln-api", "kiln-node", "kiln-rank", "kiln-webhooks"}
    assert len(set(services.values())) == 4
    assert {s.name for s in named[ADMISSION_SPAN]} == API_SPANS
    assert {s.service for name in RANK_SPANS for s in named[name]} == {"kiln-rank"}

    # the receiver sees the webhook attempt's span as its parent
    wait_until(lambda: list(receiver.deliveries), bool, timeout_s=30, what="the webhook")
    (webhook,) = named[WEBHOOK_SPAN]
    _, trace_id, parent_id, _ = receiver.deliveries[0]["traceparent"].split("-")
    assert (trace_id, parent_id) == (producer_trace, webhook.span_id)
    assert receiver.deliveries[0]["tracestate"] == "vendor=kiln-test"


def test_a_job_without_a_traceparent_starts_its_trace_at_admission(stack: TracedStack) -> None:
    response = httpx.post(
        f"{stack.api.url}/v1/jobs",
        json={"prompt": "untraced", "pipeline": "sleepy", "steps": STEPS},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert stack.cluster.wait_for(job_id).state == JobState.SUCCEEDED
    started = stack.cluster.store.get(job_id).trace["traceparent"]
    trace_id = started.split("-")[1]
    stack.collector.wait_for(has_all(trace_id, API_SPANS | NODE_SPANS | RANK_SPANS))
    spans = stack.collector.spans(trace_id)
    (admission,) = by_name(spans)[ADMISSION_SPAN]
    assert started.split("-")[2] == admission.span_id
    # the trace's root is the API's: the admission span, or FastAPI's own request span above it
    by_id = {s.span_id: s for s in spans}
    above = admission
    while above.parent_id:
        above = by_id[above.parent_id]
        assert above.service == "kiln-api", above
    assert above.parent_id == ""
    assert json.dumps(admission.attributes["kiln.job_id"]) == json.dumps(job_id)


BATCH_LINES = 50
OWN_TRACES = 10  # the first lines carry a `traceparent` field of their own


def test_a_batch_of_50_lines_is_50_job_traces_linked_to_the_batch(stack: TracedStack) -> None:
    batch_trace, batch_parent = secrets.token_hex(16), secrets.token_hex(8)
    own = {i: (secrets.token_hex(16), secrets.token_hex(8)) for i in range(OWN_TRACES)}
    lines = []
    for i in range(BATCH_LINES):
        line: dict[str, object] = {"custom_id": f"line-{i}", "prompt": f"line {i}", "steps": 2}
        if i in own:
            line["traceparent"] = f"00-{own[i][0]}-{own[i][1]}-01"
        lines.append(json.dumps(line))
    response = httpx.post(
        f"{stack.api.url}/v1/batches",
        params={"pipeline": "sleepy"},
        content="\n".join(lines).encode(),
        headers={
            "Content-Type": BATCH_INPUT_CONTENT_TYPE,
            "traceparent": f"00-{batch_trace}-{batch_parent}-01",
        },
        timeout=30,
    )
    assert response.status_code == 201, response.text
    batch_id = response.json()["id"]
    wait_until(
        lambda: httpx.get(f"{stack.api.url}/v1/batches/{batch_id}", timeout=10).json(),
        lambda view: view["status"] == "completed",
        timeout_s=240,
        what=f"batch {batch_id} completed",
    )

    stack.collector.wait_for(has_all(batch_trace, {BATCH_SPAN}))
    (batch_span,) = by_name(stack.collector.spans(batch_trace))[BATCH_SPAN]
    assert batch_span.parent_id == batch_parent
    assert batch_span.attributes["kiln.batch_id"] == batch_id

    def admissions(spans: list[CollectedSpan]) -> list[CollectedSpan]:
        return [
            s
            for s in spans
            if s.name == ADMISSION_SPAN and s.attributes.get("kiln.batch_id") == batch_id
        ]

    def every_job_ran(spans: list[CollectedSpan]) -> bool:
        traces = {s.trace_id for s in admissions(spans)}
        ran = {s.trace_id for s in spans if s.name == DENOISE_SPAN and s.trace_id in traces}
        return len(traces) == BATCH_LINES and ran == traces

    spans = stack.collector.wait_for(every_job_ran, timeout_s=60)
    jobs = admissions(spans)
    # one trace per line's job, each linked to the batch's span
    assert len({s.trace_id for s in jobs}) == len(jobs) == BATCH_LINES
    assert all(s.links == ((batch_trace, batch_span.span_id),) for s in jobs)
    by_job = {str(s.attributes["kiln.job_id"]): s for s in jobs}
    for i in range(BATCH_LINES):
        job_id = f"{batch_id}-line-{i}"
        admission = by_job[job_id]
        stored = stack.cluster.store.get(job_id).trace["traceparent"].split("-")
        assert (stored[1], stored[2]) == (admission.trace_id, admission.span_id)
        if i in own:  # the line's own trace: its job's admission is a child of its span
            assert (admission.trace_id, admission.parent_id) == own[i]
        else:  # a trace of its own
            assert admission.parent_id == ""
            assert admission.trace_id not in {t for t, _ in own.values()} | {batch_trace}
        attempt = [s for s in spans if s.trace_id == admission.trace_id and s.name == ATTEMPT_SPAN]
        assert [s.parent_id for s in attempt] == [admission.span_id]


@pytest.mark.slow  # a crash test: two group deaths and a new group
def test_a_retried_attempt_links_to_the_one_before(stack: TracedStack) -> None:
    # (last in the module: its job kills its rank twice, and the node starts a new group)
    producer_trace = secrets.token_hex(16)
    response = httpx.post(
        f"{stack.api.url}/v1/jobs",
        json={"prompt": POISON_PROMPT, "pipeline": "sleepy", "steps": STEPS},
        headers={"traceparent": f"00-{producer_trace}-{secrets.token_hex(8)}-01"},
        timeout=10,
    )
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    record = stack.cluster.wait_for(job_id, timeout_s=180)
    assert record.state == JobState.FAILED  # poison: its second group death fails it
    assert record.attempts == 2

    def two_attempts(spans: list[CollectedSpan]) -> bool:
        return sum(s.name == ATTEMPT_SPAN and s.trace_id == producer_trace for s in spans) == 2

    spans = stack.collector.wait_for(two_attempts)
    first, second = sorted(
        (s for s in spans if s.name == ATTEMPT_SPAN and s.trace_id == producer_trace),
        key=lambda s: s.start_ns,
    )
    assert (first.attributes["kiln.attempt"], second.attributes["kiln.attempt"]) == (1, 2)
    assert first.links == ()
    assert second.links == ((producer_trace, first.span_id),)
    assert first.parent_id == second.parent_id  # both the job's admission's children
