"""The stored form of a batch: one item line per valid input line, and the jobs' ids.

The API writes the input back normalized: each valid line becomes `{"n": line, "c": custom_id,
"r": spec}`, its job's spec (contract/job_spec.py: the request's defaults filled in, its seed
drawn, its version) encoded as a job record stores it, so the feeder runs no intake check again
and a line fed twice makes the same job. A job's id is derived from the batch and
the line's custom_id, `<batch id>-<custom_id>`: creating it again is a no-op, and its outputs lie
under keys named by batch and custom_id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from kiln.tasks.contract.job_spec import JobSpec


@dataclass(frozen=True)
class Item:
    """One valid line of a batch, as stored: its job's spec, decoded."""

    line: int
    custom_id: str
    spec: JobSpec
    trace: dict[str, str] = field(default_factory=dict)  # the line's own W3C trace context


def item_line(
    line: int, custom_id: str, spec: JobSpec, trace: Mapping[str, str] | None = None
) -> bytes:
    """The stored line of one valid input line (newline included), its spec's JSON as is.

    The custom_id goes in as it is: a valid one (`contract.batches.valid_custom_id`) holds only
    letters, digits, `_` and `-`, nothing JSON would escape. `trace`: the line's own W3C trace
    context (its `traceparent` field), stored as `t` where it has one.
    """
    if trace:
        own = json.dumps(dict(trace), separators=(",", ":")).encode()
        return b'{"n":%d,"c":"%s","t":%s,"r":%s}\n' % (
            line,
            custom_id.encode(),
            own,
            spec.encode_json(),
        )
    return b'{"n":%d,"c":"%s","r":%s}\n' % (line, custom_id.encode(), spec.encode_json())


def item_number(raw: bytes) -> int:
    """The input line number of a stored item line, read from its start (`{"n":<line>,`)."""
    if raw.startswith(b'{"n":'):
        end = raw.find(b",", 5)
        if end > 5 and raw[5:end].isdigit():
            return int(raw[5:end])
    return parse_item(raw).line  # written by some other writer: parse it whole


def parse_item(raw: bytes) -> Item:
    """An item from its stored line; JobSpecRefused when its spec is a newer release's."""
    data = json.loads(raw)
    trace = data.get("t")
    return Item(
        line=int(data["n"]),
        custom_id=str(data["c"]),
        spec=JobSpec.decode(data["r"]),
        trace=dict(trace) if isinstance(trace, dict) else {},
    )


def batch_job_id(batch_id: str, custom_id: str) -> str:
    """The id of the job of one line: `<batch id>-<custom_id>` (a valid job id)."""
    return f"{batch_id}-{custom_id}"


def custom_id_of(batch_id: str, job_id: str) -> str:
    """The custom_id a batch job's id carries."""
    return job_id[len(batch_id) + 1 :]
