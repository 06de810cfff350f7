"""Hypothesis strategies for hostile requests, built as raw bytes.

Job bodies hold at least one value Python's `json` parses but the API must refuse (NaN,
Infinity, integers past 64 bits, lone surrogates, NUL, invalid UTF-8, nesting past 32 levels),
somewhere: a known field, an unknown one, a key, deep in metadata. Requests carry odd bytes in
headers, query strings and path ids, all still well-formed HTTP (malformed HTTP is httptools' to
refuse, and it rightly closes the connection).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote_from_bytes

from hypothesis import strategies as st

from tests.tasks.raw_http import strict_json

JSON_TYPE = (b"Content-Type", b"application/json")
JOB = b'{"prompt":"a kiln","width":64,"height":64,"steps":2'
FIELDS = [
    "pipeline",
    "prompt",
    "negative_prompt",
    "width",
    "height",
    "num_frames",
    "fps",
    "steps",
    "guidance_scale",
    "seed",
    "num_outputs",
    "output_format",
    "priority",
    "webhook",
    "start_by",
    "max_run_seconds",
    "metadata",
]
# what httptools (llhttp) refuses in a header value, as RFC 9110 does: control bytes and DEL
# (and tab, which it takes only inside a value)
_NOT_IN_HEADERS = frozenset([*range(0x20), 0x7F])


@dataclass(frozen=True)
class RawRequest:
    """A request as bytes (the Authorization header is added by the sender)."""

    method: str
    target: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes | None = None


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # ensure_ascii: astral characters as surrogate *pairs*


_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=8
)
ordinary = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    _text,
).map(_dumps)
_piece = _text.map(lambda text: _dumps(text)[1:-1])  # string content, escaped

non_finite = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1E400", b"9e9999"])
huge_ints = st.one_of(
    st.integers(min_value=2**64, max_value=2**300),
    st.integers(min_value=-(2**300), max_value=-(2**64)),
).map(lambda n: str(n).encode())
digit_walls = st.integers(21, 6000).map(lambda n: b"9" * n)  # past int()'s 4300-digit limit too
# One escape, between escaped text that never ends in a lone high surrogate nor starts with a
# low one: the surrogate stays lone (a high one followed by a low one would make a valid pair).
_bad_in_string = st.one_of(
    st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}".encode()),
    st.just(b"\\u0000"),
    st.just(b"\x00"),  # raw: not even valid JSON
    st.binary(min_size=1, max_size=4).map(lambda b: bytes(0x80 | c for c in b)),  # not UTF-8
)
hostile_strings = st.tuples(_piece, _bad_in_string, _piece).map(
    lambda parts: b'"' + b"".join(parts) + b'"'
)
deep = st.integers(33, 3000).flatmap(
    lambda n: st.sampled_from([b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n])
)
hostile_leaves = st.one_of(non_finite, huge_ints, digit_walls, hostile_strings, deep)


def _containing(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Containers that hold one of `children` among ordinary values, or a hostile key."""
    in_list = st.tuples(st.lists(ordinary, max_size=3), children, st.lists(ordinary, max_size=3))
    return st.one_of(
        in_list.map(lambda t: b"[" + b",".join([*t[0], t[1], *t[2]]) + b"]"),
        st.tuples(_text.map(_dumps), children).map(lambda kv: b"{" + kv[0] + b":" + kv[1] + b"}"),
        st.tuples(hostile_strings, children).map(lambda kv: b"{" + kv[0] + b":" + kv[1] + b"}"),
    )


hostile_values = st.recursive(hostile_leaves, _containing, max_leaves=4)


@st.composite
def job_bodies(draw: st.DrawFn) -> bytes:
    """A job request with a hostile value in some field (known, unknown, a key) or as the body."""
    value = draw(hostile_values)
    where = draw(st.sampled_from(["field", "unknown", "key", "metadata", "webhook", "body"]))
    if where == "body":
        return value
    if where == "key":
        return JOB + b"," + draw(hostile_strings) + b":" + draw(ordinary) + b"}"
    name = draw(st.sampled_from(FIELDS)) if where == "field" else f"x-{draw(_text)}"
    if where == "metadata":
        name, value = "metadata", b'{"k":' + value + b"}"
    if where == "webhook":
        name, value = "webhook", b'{"url":"https://example.com/h","events":' + value + b"}"
    return JOB + b"," + _dumps(name) + b":" + value + b"}"


def assert_names_a_field(body: bytes) -> None:
    """A 422 body is standard JSON, and each error names a place in the request body."""
    errors = strict_json(body)["detail"]
    assert errors, body
    for error in errors:
        assert error["loc"][0] == "body", error
        assert isinstance(error["msg"], str), error


header_values = st.binary(min_size=1, max_size=64).map(
    lambda raw: bytes(c for c in raw if c not in _NOT_IN_HEADERS) or b"x"
)
_encoded = st.binary(max_size=40).map(lambda raw: quote_from_bytes(raw, safe=b"").encode())
numbers = st.one_of(
    st.integers().map(lambda n: str(n).encode()),
    st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, 2**64, -1]).map(lambda n: str(n).encode()),
    st.sampled_from([b"", b"-0", b"1e3", b"0x10", b"NaN", b"Infinity", b" 1", b"1.5"]),
    digit_walls,
    _encoded,
)
_QUERY_NAMES = [b"after", b"limit", b"cursor", b"status", b"owner", b"batch_id", b"pipeline"]


@st.composite
def requests(draw: st.DrawFn, job_id: str) -> RawRequest:
    """An odd header, query string or path id on some route (`job_id`: a finished job)."""
    job = f"/v1/jobs/{job_id}".encode()
    kind = draw(st.sampled_from(["idempotency", "last_event_id", "query", "path"]))
    if kind == "idempotency":
        headers = [JSON_TYPE, (b"Idempotency-Key", draw(header_values))]
        return RawRequest("POST", b"/v1/jobs", headers, JOB + b"}")
    if kind == "last_event_id":
        value = draw(st.one_of(header_values, numbers.filter(lambda v: b"%" not in v)))
        return RawRequest("GET", job + b"/events", [(b"Last-Event-ID", value)])
    if kind == "query":
        route = draw(st.sampled_from([b"/v1/jobs", job, job + b"/events", b"/v1/nodes"]))
        name = draw(st.one_of(st.sampled_from(_QUERY_NAMES), _encoded))
        value = draw(numbers.map(lambda raw: quote_from_bytes(raw, safe=b"%").encode()))
        return RawRequest("GET", route + b"?" + name + b"=" + value)
    job_path = b"/v1/jobs/" + draw(_encoded)
    suffix, method = draw(
        st.sampled_from(
            [(b"", "GET"), (b"/events", "GET"), (b"/webhooks", "GET"), (b"/cancel", "POST")]
        )
    )
    return RawRequest(method, job_path + suffix)
