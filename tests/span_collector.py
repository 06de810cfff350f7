"""An OTLP/HTTP trace collector for tests: the spans Kiln's processes export, decoded.

Each process exports with OpenTelemetry's own OTLP/HTTP exporter (`OTEL_TRACES_EXPORTER=otlp`)
to this server, which decodes every `ExportTraceServiceRequest` (opentelemetry-proto) into
`CollectedSpan`s with the service and pid of the process that sent them.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class CollectedSpan:
    """One exported span, ids as hex (parent "" for a root)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    service: str
    pid: int
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    events: tuple[tuple[str, dict[str, object]], ...]
    links: tuple[tuple[str, str], ...]  # (trace id, span id) each


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: object) -> dict[str, object]:
    return {pair.key: _value(pair.value) for pair in pairs}  # type: ignore[attr-defined]


def decode(body: bytes) -> list[CollectedSpan]:
    """The spans of one OTLP/HTTP protobuf export request."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    CollectedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        service=str(resource.get("service.name", "")),
                        pid=int(resource.get("process.pid", 0) or 0),  # type: ignore[call-overload]
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        events=tuple((e.name, _attributes(e.attributes)) for e in span.events),
                        links=tuple((k.trace_id.hex(), k.span_id.hex()) for k in span.links),
                    )
                )
    return found


class SpanCollector:
    """The spans received so far (thread-safe), and the endpoint to send them to."""

    def __init__(self, port: int) -> None:
        self.endpoint = f"http://127.0.0.1:{port}/v1/traces"
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()

    def add(self, spans: list[CollectedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self, trace_id: str | None = None) -> list[CollectedSpan]:
        """Every span received, or those of one trace."""
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def env(self) -> dict[str, str]:
        """The `OTEL_*` variables that make a Kiln process export here, promptly."""
        return {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: a test waits for spans, not for batches
        }

    def wait_for(
        self, wanted: Callable[[list[CollectedSpan]], bool], timeout_s: float = 30.0
    ) -> list[CollectedSpan]:
        """Poll until `wanted(spans)`; AssertionError naming what came after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if wanted(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans not collected in {timeout_s} s; have {names}")
            time.sleep(0.05)


@contextmanager
def span_collector() -> Iterator[SpanCollector]:
    """A collector serving on a free loopback port until the block ends."""
    collector: SpanCollector

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            collector.add(decode(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    collector = SpanCollector(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield collector
    finally:
        server.shutdown()
        server.server_close()
