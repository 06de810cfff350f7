"""Traces from producer to rank: the W3C trace context a job carries, and its spans.

A job's trace context is a W3C carrier (`traceparent`, and `tracestate` where given): accepted
at every entrance (the HTTP header, the Python client and `kiln submit`, a batch line's field)
or started there, stored on the job record (`trace`), carried in the job's Celery message
headers to its node, in its `GenerationRequest` to rank 0, and in each webhook delivery's
`traceparent` header. Parsing and writing the carrier is OpenTelemetry's W3C propagator
(`TraceContextTextMapPropagator`, in the API package): never a parser of Kiln's own.

Spans are OpenTelemetry's SDK with the exporters it names, configured by the standard `OTEL_*`
variables: off unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`, any other
installed one) or `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set
(then `otlp`, OTLP over HTTP/protobuf); `OTEL_SDK_DISABLED=true` keeps it off. Off, no SDK is
loaded and every `span` is one flag test: a carrier given by the caller is still stored and
passed on as it came. Each process calls `start_tracing(service)` once as it starts (the API, a
node, each rank, a webhooks worker); `OTEL_SERVICE_NAME` overrides the service name.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

Carrier = dict[str, str]
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
# the instrumentation scope of every Kiln span
TRACER_NAME: Final = "kiln"
# The spans of a job's trace, by the process that makes them (docs/operations.md, tracing).
ADMISSION_SPAN: Final = "kiln.admission"  # the API (or a Python caller): checks and write
BATCH_SPAN: Final = "kiln.batch"  # the API: a batch's upload; its line jobs link to it
QUEUE_WAIT_SPAN: Final = "kiln.queue_wait"  # the node: from the job's write to its start
ATTEMPT_SPAN: Final = "kiln.attempt"  # the node: one delivery's attempt
ENCODE_SPAN: Final = "kiln.encode"  # the node: the outputs' encoding
UPLOAD_SPAN: Final = "kiln.upload"  # the node: one output's upload
WAKE_SPAN: Final = "kiln.wake"  # rank 0: a sleeping group's wake before the job's forward
DENOISE_SPAN: Final = "kiln.denoise"  # rank 0: the pipeline call (steps as `step` events)
TEXT_ENCODING_SPAN: Final = "kiln.text_encoding"  # rank 0: the call up to the first step
DECODE_SPAN: Final = "kiln.decode"  # rank 0: the call after the last step
WEBHOOK_SPAN: Final = "kiln.webhook"  # the webhooks worker: one delivery attempt
STEP_EVENT: Final = "step"
JOB_ID_ATTRIBUTE: Final = "kiln.job_id"
QUEUE_ATTRIBUTE: Final = "kiln.queue"
BATCH_ID_ATTRIBUTE: Final = "kiln.batch_id"
ATTEMPT_ATTRIBUTE: Final = "kiln.attempt"
NODE_ATTRIBUTE: Final = "kiln.node"
BATCH_ITEMS_ATTRIBUTE: Final = "kiln.batch_items"
WEBHOOK_EVENT_ATTRIBUTE: Final = "kiln.webhook_event"
WEBHOOK_ATTEMPT_ATTRIBUTE: Final = "kiln.webhook_attempt"
WEBHOOK_OUTCOME_ATTRIBUTE: Final = "kiln.webhook_outcome"
# OTEL_TRACES_EXPORTER's `otlp`: the OTLP exporter installed with Kiln (HTTP/protobuf)
_OTLP_EXPORTERS: Final = {"otlp": "otlp_proto_http"}

_propagator = TraceContextTextMapPropagator()
# a span's parent that makes it the root of a trace of its own, whatever span is current
ROOT: Final = Context()
_lock = threading.Lock()
_provider: Any = None  # the SDK's TracerProvider of this process, once started
_provider_pid = 0  # the process that started it (a forked child starts its own)
_tracer: Any = None
_enabled = False


def tracing_asked(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the `OTEL_*` variables ask for spans (the exporter, or an OTLP endpoint)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(_exporter_names(env))


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    named = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if named:
        return [] if named == ["none"] else [n for n in named if n != "none"]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    return ["otlp"] if endpoint else []


def start_tracing(service: str) -> bool:
    """Set up this process's span export when the `OTEL_*` variables ask; whether it is on.

    Once per process: a second call keeps the first provider. A process forked from one that
    started (ranks from the rank server) starts its own, under its own service name.
    """
    global _provider, _provider_pid, _tracer, _enabled
    with _lock:
        if _provider is not None and _provider_pid == os.getpid():
            return True
        names = _exporter_names(os.environ) if tracing_asked() else []
        if not names:
            return False
        # Deferred: the SDK and its exporters load only where tracing is on.
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes: dict[str, Any] = {"process.pid": os.getpid()}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes[SERVICE_NAME] = service
        provider = TracerProvider(resource=Resource.create(attributes))
        for name in names:
            provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
        # Not made the global provider: Kiln's spans alone (a library's own, FastAPI's, stay off),
        # and a process that stops tracing leaves no provider of it behind.
        _provider, _provider_pid, _enabled = provider, os.getpid(), True
        _tracer = provider.get_tracer(TRACER_NAME)
        return True


def _exporter(name: str) -> Any:
    """The span exporter an `OTEL_TRACES_EXPORTER` name stands for (its entry point)."""
    from importlib.metadata import entry_points  # deferred: read only where tracing is on

    wanted = _OTLP_EXPORTERS.get(name, name)
    found = entry_points(group="opentelemetry_traces_exporter", name=wanted)
    if not found:
        raise ValueError(f"OTEL_TRACES_EXPORTER names {name!r}: no such span exporter installed")
    return next(iter(found)).load()()


def flush_tracing(timeout_s: float = 5.0) -> None:
    """Export the spans this process still holds (before an exit that skips atexit hooks)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def stop_tracing() -> None:
    """Export what is held and stop (a test's process goes back to tracing off)."""
    global _provider, _tracer, _enabled
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _provider, _tracer, _enabled = None, None, False


def tracing_on() -> bool:
    """Whether this process exports spans (`start_tracing` found them asked for)."""
    return _enabled


def context_of(carrier: Mapping[str, str] | None) -> Context | None:
    """The context a W3C carrier names; None for none, or one without a valid `traceparent`."""
    if not carrier or TRACEPARENT not in carrier:
        return None
    context = _propagator.extract(carrier)
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


def valid_carrier(carrier: Mapping[str, str] | None) -> Carrier:
    """The carrier as the propagator reads and writes it back; {} when it is not valid W3C."""
    context = context_of(carrier)
    return {} if context is None else carrier_of(context)


def carrier_of(context: Context | Span | None) -> Carrier:
    """The W3C carrier of a context or span ({} for none, or an invalid one)."""
    if context is None:
        return {}
    if isinstance(context, Span):
        context = trace.set_span_in_context(context)
    carrier: Carrier = {}
    _propagator.inject(carrier, context)
    return carrier


def given_carrier(traceparent: str | None, tracestate: str | None = None) -> Carrier:
    """The carrier of a caller's `traceparent` and `tracestate` (headers, options); {} for none."""
    if not traceparent:
        return {}
    given = {TRACEPARENT: traceparent}
    if tracestate:
        given[TRACESTATE] = tracestate
    return valid_carrier(given)


def current_carrier() -> Carrier:
    """The carrier of this thread's current span (a producer's own trace); {} without one.

    The span may be the application's own (a Python caller with an SDK of its own set up).
    """
    current = trace.get_current_span()
    return carrier_of(current) if current.get_span_context().is_valid else {}


def job_carrier(entrance: Span | None, given: Mapping[str, str] | None) -> Carrier:
    """What a job stores: its entrance's span (tracing on), else the caller's carrier as given."""
    if entrance is not None:
        return carrier_of(entrance)
    return valid_carrier(given)


def message_carrier(request: Any) -> Carrier:
    """The W3C carrier of a Celery task's message headers (its `request`); {} without one."""
    headers = getattr(request, "headers", None) or {}
    found = {}
    for name in (TRACEPARENT, TRACESTATE):
        value = getattr(request, name, None) or headers.get(name)
        if isinstance(value, str) and value:
            found[name] = value
    return valid_carrier(found)


def trace_id_of(carrier: Mapping[str, str] | None) -> str | None:
    """The trace id (32 hex digits) of a carrier, for logs and views; None without one."""
    context = context_of(carrier)
    if context is None:
        return None
    return format(trace.get_current_span(context).get_span_context().trace_id, "032x")


def _parent(parent: Context | Mapping[str, str] | Span | None) -> Context | None:
    if parent is None or isinstance(parent, Context):
        return parent
    if isinstance(parent, Span):
        return trace.set_span_in_context(parent)
    return context_of(parent)


def _links(links: Sequence[Mapping[str, str] | Span | None]) -> list[Link]:
    found = []
    for link in links:
        if isinstance(link, Span):
            found.append(Link(link.get_span_context()))
            continue
        context = context_of(link)
        if context is not None:
            found.append(Link(trace.get_current_span(context).get_span_context()))
    return found


@contextmanager
def span(
    name: str,
    parent: Context | Mapping[str, str] | Span | None = None,
    *,
    links: Sequence[Mapping[str, str] | Span | None] = (),
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    start_s: float | None = None,
) -> Iterator[Span | None]:
    """A span named `name`, child of `parent` (else of the current span); None when off.

    `links`: spans or carriers this one follows from (a batch's span, a previous attempt).
    `start_s`: its start as epoch seconds, where it began before this call (a queue wait).
    """
    if not _enabled:
        yield None
        return
    with _tracer.start_as_current_span(
        name,
        context=_parent(parent),
        kind=kind,
        links=_links(links),
        attributes=dict(attributes or {}),
        start_time=None if start_s is None else int(start_s * 1e9),
    ) as current:
        yield current


def record_span(
    name: str,
    parent: Context | Mapping[str, str] | Span | None,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
    events: Sequence[tuple[str, float, Mapping[str, Any]]] = (),
) -> Span | None:
    """A span already over (start and end as epoch seconds): a job's wait in its queue.

    `events`: (name, epoch seconds, attributes) each. Returns the span, a parent for others.
    """
    if not _enabled:
        return None
    made = _tracer.start_span(
        name,
        context=_parent(parent),
        attributes=dict(attributes or {}),
        start_time=int(start_s * 1e9),
    )
    for event, at_s, facts in events:
        made.add_event(event, dict(facts), int(at_s * 1e9))
    made.end(end_time=int(max(end_s, start_s) * 1e9))
    return made  # type: ignore[no-any-return]


def set_span_attributes(attributes: Mapping[str, Any]) -> None:
    """Attributes of this thread's current span (found after it began: the job's id)."""
    if _enabled:
        trace.get_current_span().set_attributes(dict(attributes))


def add_event(target: Span | None, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """An event on a span (a denoising step); nothing when tracing is off."""
    if target is not None:
        target.add_event(name, dict(attributes or {}), int(time.time() * 1e9))


__all__ = [
    "ADMISSION_SPAN",
    "ATTEMPT_ATTRIBUTE",
    "ATTEMPT_SPAN",
    "BATCH_ID_ATTRIBUTE",
    "BATCH_ITEMS_ATTRIBUTE",
    "BATCH_SPAN",
    "DECODE_SPAN",
    "DENOISE_SPAN",
    "ENCODE_SPAN",
    "JOB_ID_ATTRIBUTE",
    "NODE_ATTRIBUTE",
    "QUEUE_ATTRIBUTE",
    "QUEUE_WAIT_SPAN",
    "ROOT",
    "STEP_EVENT",
    "TEXT_ENCODING_SPAN",
    "TRACEPARENT",
    "TRACESTATE",
    "UPLOAD_SPAN",
    "WAKE_SPAN",
    "WEBHOOK_ATTEMPT_ATTRIBUTE",
    "WEBHOOK_EVENT_ATTRIBUTE",
    "WEBHOOK_OUTCOME_ATTRIBUTE",
    "WEBHOOK_SPAN",
    "Carrier",
    "SpanKind",
    "add_event",
    "carrier_of",
    "context_of",
    "current_carrier",
    "flush_tracing",
    "given_carrier",
    "job_carrier",
    "message_carrier",
    "record_span",
    "set_span_attributes",
    "span",
    "start_tracing",
    "stop_tracing",
    "trace_id_of",
    "tracing_asked",
    "tracing_on",
    "valid_carrier",
]
