"""The span of one attempt of a job: a child of the job's trace context, linked to the previous.

Tracing on, an attempt reads the context its job's previous attempt noted (a retry, a job handed
back or preempted and resumed, a lapsed lease run again), links its `kiln.attempt` span to it and
notes its own for the next (storage/attempt_traces.py). Tracing off it reads and writes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kiln.common.tracing import (
    ATTEMPT_ATTRIBUTE,
    ATTEMPT_SPAN,
    JOB_ID_ATTRIBUTE,
    NODE_ATTRIBUTE,
    carrier_of,
    span,
    tracing_on,
)
from kiln.storage.attempt_traces import AttemptTraces
from kiln.storage.errors import StorageError
from kiln.storage.job_store import JobRecord, JobStore

log = logging.getLogger(__name__)


@contextmanager
def attempt_span(
    store: JobStore, node_id: str, record: JobRecord, trace: Mapping[str, str]
) -> Iterator[None]:
    """The attempt's span around its run; `trace`: its message's context (else its record's)."""
    if not tracing_on():
        yield
        return
    traces = AttemptTraces(store.redis, store.settings)
    previous: dict[str, str] = {}
    try:
        previous = traces.previous(record.id)
    except StorageError as exc:  # a link the less, never a failed job
        log.debug("job %s: previous attempt's trace unread (%s)", record.id, exc)
    facts = {
        JOB_ID_ATTRIBUTE: record.id,
        ATTEMPT_ATTRIBUTE: record.attempts + 1,
        NODE_ATTRIBUTE: node_id,
    }
    with span(ATTEMPT_SPAN, trace or record.trace, links=[previous], attributes=facts) as current:
        try:
            traces.note(record.id, carrier_of(current))
        except StorageError as exc:
            log.debug("job %s: this attempt's trace not noted (%s)", record.id, exc)
        yield
