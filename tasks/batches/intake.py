"""Accepting a batch file: every line validated as it streams past, valid ones stored normalized.

`BatchIntake` takes the body in chunks of any size (`feed`), never more than one line at a time
beyond the chunk it holds, and writes the valid lines to the batch's input object through a
streamed writer (`storage.object_streams`), `WRITE_BYTES` at a time. A line must be a JSON
object: a job request (the same rules as POST /v1/jobs: strict JSON, the schema, a known
pipeline, its limits, the webhook rules) plus a `custom_id` unique in the file, or the same in
OpenAI's Batch form (`method` POST, `url` /v1/jobs, the request as `body`). Every check past
the schema is the intake's (`tasks.intake`, `LineIntake`), the one POST /v1/jobs runs: image inputs
and webhooks included, each distinct one looked up once per file. Lines without
`pipeline` or `priority` take the batch's defaults. Blank lines are skipped (they still count for
line numbers).

The input is stored normalized: each valid line becomes an item line `{"n": line, "c": custom_id,
"r": spec}` (`item_line`), its job's spec (contract/job_spec.py: the request's defaults filled in,
its seed drawn, its version) encoded as a job record stores it, so the feeder runs no intake check
again and a line fed twice makes the same job. A job's id is derived from the batch and the line's
custom_id, `<batch id>-<custom_id>` (`batch_job_id`): creating it again is a no-op, and its outputs
lie under keys named by batch and custom_id. The feeder and a retry read the items back
(`parse_item`).

Most lines skip the strict-JSON walk (`plain_text` proves from the bytes that it would pass), and
custom_ids are checked for repeats at the end (`unique_ids`, spilled to temporary files), so the
API's memory stays flat however long the file: a repeat is known only once the file is read.
Without skip_invalid it then joins the refusal; with it, the repeated lines already written are
dropped from the committed input (`drop_repeats`: only a file with repeats pays for this copy).

A line's errors have POST /v1/jobs's shape, `loc` relative to the line as `api.job_routes` gives
it for one request; `located` makes it the refused file's (from the body, with the line number).

Without `skip_invalid` one invalid line refuses the whole file: the report carries the first
errors (line number, field, reason) and the total count, and the caller aborts the writer. With
it, each invalid line becomes an `invalid` result line of its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import ValidationError

from kiln.common.defaults import BATCH_LANE
from kiln.common.tracing import TRACEPARENT, TRACESTATE, Carrier, given_carrier
from kiln.storage.object_base import ObjectStore, StoredObject
from kiln.storage.object_streams import ObjectWriter, iter_lines, open_writer
from kiln.tasks.batches.results import Error, invalid_line
from kiln.tasks.batches.unique_ids import CustomIds, Repeat
from kiln.tasks.contract.batches import (
    CUSTOM_ID_MAX,
    LineShapeError,
    in_openai_form,
    openai_line_request,
    valid_custom_id,
)
from kiln.tasks.contract.job_spec import JobSpec
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import LineIntake
from kiln.tasks.intake.refusal import Refusal, Refused

# Strict-JSON errors of one line (the API's `json_guard.body_errors`): loc starts with "body".
JsonCheck = Callable[[bytes], list[dict[str, Any]]]
MAX_ERRORS_SHOWN = 20
# item lines gathered before they go to the writer at once (one digest update and write each)
WRITE_BYTES = 256 * 1024
# lines read to their schema before their lookups are made at once: a few round trips' worth,
# few enough that the requests held meanwhile stay young for the garbage collector
STAGE_LINES = 64
# far above any valid request (4000-char prompts, 16 metadata entries, a 2 KiB webhook URL)
DEFAULT_MAX_LINE_BYTES = 256 * 1024
# what `plain_text` leaves to `body_errors`: bytes that might not be plain
_SUSPECT = re.compile(
    rb"\\u(?:0000|[dD][89a-fA-F])"  # an escaped NUL or surrogate
    rb"|NaN|Infinity"
    rb"|[0-9](?:[eE][-+]?[0-9]{3}|[0-9]{19})"  # a big exponent, 20 digits in a row
)
# `_SUSPECT` in parts that are each fast to find in a whole block of lines (`suspect_starts`)
_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")
_SUSPECT_NAMES = (b"NaN", b"Infinity")
_AS_ZEROS = bytes.maketrans(b"0123456789E-", b"0000000000e+")
_SUSPECT_NUMBERS = (b"0e000", b"0e+000", b"0" * 20)


@dataclass(frozen=True)
class LineDefaults:
    """What a batch gives every line that does not say otherwise.

    `pipeline`, `priority` and `webhook` fill a line's missing field; `metadata` entries are added
    to a line's own (the line's win).
    """

    pipeline: str | None = None
    priority: str = BATCH_LANE
    webhook: dict[str, Any] | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def apply(self, data: dict[str, Any]) -> None:
        """Fill `data` (a parsed line) in place."""
        data.setdefault("priority", self.priority)
        if self.pipeline is not None:
            data.setdefault("pipeline", self.pipeline)
        if self.webhook is not None:
            data.setdefault("webhook", self.webhook)
        own = data.get("metadata")
        if self.metadata and (own is None or isinstance(own, dict)):
            data["metadata"] = {**self.metadata, **(own or {})}


def line_carrier(data: dict[str, Any]) -> Carrier | None:
    """A line's own `traceparent` and `tracestate` fields, taken out of its request.

    A value that is no valid W3C trace context is dropped, as the HTTP header's is: the line's
    job then starts a trace of its own (still linked to its batch's).
    """
    traceparent, tracestate = data.pop(TRACEPARENT, None), data.pop(TRACESTATE, None)
    if not isinstance(traceparent, str):
        return None
    return given_carrier(traceparent, tracestate if isinstance(tracestate, str) else None) or None


class Staged(NamedTuple):
    """A line read up to its schema: number, custom_id, request or errors, where the request sits.

    `within` is `("body",)` for a line in OpenAI's form (its errors point into the body).
    """

    number: int
    custom_id: str | None
    outcome: JobRequest | list[Error]
    within: tuple[str, ...] = ()
    trace: Carrier | None = None  # the line's `traceparent` and `tracestate` fields


@dataclass
class IntakeReport:
    """What an intake found: line counts, the first errors, the objects written."""

    items: int = 0  # valid non-blank lines
    invalid: int = 0  # invalid ones
    errors: list[Error] = field(default_factory=list)  # the first ones, each with its `line`
    items_object: StoredObject | None = None
    invalid_object: StoredObject | None = None

    @property
    def lines(self) -> int:
        """Non-blank lines of the file."""
        return self.items + self.invalid

    @property
    def refused(self) -> bool:
        """Whether the file is refused (errors without skip_invalid, no lines, or no valid line)."""
        return bool(self.errors)


class BatchIntake:
    """Validates a batch file chunk by chunk and streams its valid lines to `items`.

    `invalid` receives the invalid lines' result lines (pass it for skip_invalid, else None).
    `max_json_depth` must be the one `json_errors` checks.
    """

    def __init__(
        self,
        *,
        checks: LineIntake,
        json_errors: JsonCheck,
        objects: ObjectStore,
        items: ObjectWriter,
        max_json_depth: int,
        invalid: ObjectWriter | None = None,
        defaults: LineDefaults | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        self.checks = checks
        self.json_errors = json_errors
        self.objects = objects  # the writers' store: read back only to drop repeated lines
        self.items = items
        self.invalid = invalid
        self.defaults = defaults or LineDefaults()
        self.max_line_bytes = max_line_bytes
        self.max_json_depth = max_json_depth  # `json_errors`' own: lines within skip its walk
        self.report = IntakeReport()
        self._number = 0  # physical line number of the last line seen
        self._rest = b""
        self._overlong = False  # the line being read is past max_line_bytes: skip to its end
        self._ids = CustomIds()
        self._pending = bytearray()  # item lines not handed to `items` yet

    @property
    def skip_invalid(self) -> bool:
        """Whether invalid lines become results instead of refusing the file."""
        return self.invalid is not None

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the body (any size; lines may span chunks)."""
        data = self._rest + chunk
        parts = data.split(b"\n")
        self._rest = parts.pop()
        texts = plain_texts(data, parts, self.max_json_depth)
        lines = list(zip(parts, texts, strict=True))
        for start in range(0, len(lines), STAGE_LINES):
            staged = [self._stage(raw, text) for raw, text in lines[start : start + STAGE_LINES]]
            # their image inputs and webhook URLs looked up together, before any line is settled
            self.checks.prefetch([line.outcome for line in staged if line is not None])
            for line in staged:
                if line is not None:
                    self._settle(line)
        if len(self._rest) > self.max_line_bytes:
            if not self._overlong:
                self._refuse(self._number + 1, None, [too_long(self.max_line_bytes)])
            self._overlong, self._rest = True, b""

    def finish(self) -> IntakeReport:
        """The last line (without a final newline), then the report; commits what was written.

        A refused file's objects are left to the caller to abort (nothing is committed).
        """
        if self._rest or self._overlong:
            last = self._stage(self._rest, plain_text(self._rest, self.max_json_depth))
            if last is not None:
                self._settle(last)
            self._rest = b""
        repeated = self._refuse_repeats()
        report = self.report
        if report.lines == 0:
            report.errors.append(
                {"type": "batch_empty", "loc": ["body"], "msg": "the batch has no lines", "line": 0}
            )
        elif report.items == 0:  # skip_invalid, every line invalid: nothing would ever run
            msg = f"no valid line: all {report.invalid} lines are invalid"
            report.errors.append(
                {"type": "batch_no_valid_lines", "loc": ["body"], "msg": msg, "line": 0}
            )
        if report.refused:
            return report
        self.items.write(bytes(self._pending))
        self._pending.clear()
        report.items_object = self.items.commit()
        if repeated and self.invalid is not None:  # written before they were known to repeat
            report.items_object = drop_repeats(self.objects, report.items_object, repeated)
        if self.invalid is not None and report.invalid:
            report.invalid_object = self.invalid.commit()
        return report

    def abort(self) -> None:
        """Drop everything written (a refused or interrupted upload)."""
        self._ids.close()
        self.items.abort()
        if self.invalid is not None:
            self.invalid.abort()

    def _stage(self, raw: bytes, text: str | None) -> Staged | None:
        """One line up to its schema; None for a blank line or a too-long one's end.

        `text` is the line if the screen proved it plain, else None.
        """
        self._number += 1
        if self._overlong:  # the end of a line already refused as too long
            self._overlong = False
            return None
        if len(raw) > self.max_line_bytes:
            return Staged(self._number, None, [too_long(self.max_line_bytes)])
        if not raw.strip():
            return None
        return Staged(self._number, *self._validate(raw, text))

    def _settle(self, line: Staged) -> None:
        """The intake's checks of a staged line, then its item (or its refusal)."""
        custom_id, outcome = line.custom_id, line.outcome
        if isinstance(outcome, JobRequest):
            checked = self.checks.check(outcome)  # the seed drawn there, stored with the line
            if isinstance(checked, Refusal):
                if checked.status != 422:  # not the line's fault (the object store is down)
                    raise Refused(checked)
                outcome = [under(line.within, checked.error())]
            else:
                outcome = checked
        valid = not isinstance(outcome, list)
        if custom_id is not None:
            self._ids.add(line.number, custom_id, valid)
        if isinstance(outcome, list):
            self._refuse(line.number, custom_id, outcome)
            return
        assert custom_id is not None
        self.report.items += 1
        if not self.report.errors:  # a refused file writes nothing more
            self._pending += item_line(line.number, custom_id, JobSpec.of(outcome), line.trace)
            if len(self._pending) >= WRITE_BYTES:
                self.items.write(bytes(self._pending))
                self._pending.clear()

    def _parse(self, raw: bytes, text: str | None) -> tuple[Any, list[Error]]:
        """The line's JSON value, or its strict-JSON errors (`text`: the line, if plain)."""
        if text is not None:
            try:
                return json.loads(text), []
            except ValueError:
                pass  # not JSON at all: `json_errors` says where
        problems = self.json_errors(raw)
        if problems:
            return None, [strip_body(error) for error in problems]
        return json.loads(raw), []

    def _validate(
        self, raw: bytes, text: str | None
    ) -> tuple[str | None, JobRequest | list[Error], tuple[str, ...], Carrier | None]:
        """The line's custom_id, its request as the schema reads it or its errors, its trace."""
        data, problems = self._parse(raw, text)
        if problems:
            return None, problems, (), None
        if not isinstance(data, dict):
            not_object = {"type": "dict_type", "loc": [], "msg": "a line must be a JSON object"}
            return None, [not_object], (), None
        custom_id = data.pop("custom_id", None)
        if custom_id is None:
            missing = {"type": "missing", "loc": ["custom_id"], "msg": "Field required"}
            return None, [missing], (), None
        if not valid_custom_id(custom_id):
            bad_id = {"type": "custom_id", "loc": ["custom_id"], "msg": CUSTOM_ID_MSG}
            return None, [bad_id], (), None
        trace = line_carrier(data)
        within: tuple[str, ...] = ()  # where the request sits in the line
        if in_openai_form(data):
            try:
                data, within = openai_line_request(data), ("body",)
            except LineShapeError as exc:
                shape = {"type": "line_shape", "loc": [exc.field], "msg": str(exc)}
                return custom_id, [shape], (), None
        self.defaults.apply(data)
        try:
            request = JobRequest.model_validate(data)
        except ValidationError as exc:
            errors = self.checks.restated(list(exc.errors()), data)
            return custom_id, [under(within, plain_error(error)) for error in errors], within, None
        return custom_id, request, within, trace

    def _refuse_repeats(self) -> set[int]:
        """Refuse the lines whose custom_id repeats an earlier one's; their numbers.

        A repeated line refused for its own reasons already is not counted again (without
        skip_invalid its repeat is listed beside those reasons). Without skip_invalid the repeats
        join the first errors in line order; with it, the lines returned were written as items
        and must be dropped from the input.
        """
        report, shown, dropped = self.report, list[Error](), set[int]()
        try:
            for repeat in self._ids.repeats():
                if not repeat.valid:  # counted already: the repeat only adds its reason
                    if not self.skip_invalid and len(shown) < MAX_ERRORS_SHOWN:
                        shown.append(located(repeat.line, repeat_error(repeat)))
                    continue
                report.items -= 1
                if self.skip_invalid:
                    dropped.add(repeat.line)
                self._refuse(repeat.line, repeat.custom_id, [repeat_error(repeat)], shown)
        finally:
            self._ids.close()
        if shown:
            report.errors = sorted(report.errors + shown, key=lambda e: e["line"])
            del report.errors[MAX_ERRORS_SHOWN:]
        return dropped

    def _refuse(
        self,
        number: int,
        custom_id: str | None,
        errors: list[Error],
        shown: list[Error] | None = None,
    ) -> None:
        """Count the line invalid: its result line (skip_invalid), else its errors in `shown`."""
        report = self.report
        report.invalid += 1
        if self.invalid is not None:
            self.invalid.write(invalid_line(number, custom_id, errors))
            return
        shown = report.errors if shown is None else shown
        for error in errors:
            if len(shown) < MAX_ERRORS_SHOWN:
                shown.append(located(number, error))


# --- a line's screen and errors, and the repeats dropped -------------------------------------


def plain_text(raw: bytes, max_depth: int) -> str | None:
    r"""The line as text if it plainly holds nothing `body_errors` refuses, else None.

    A cheap proof, from the line's bytes alone, that the API's strict-JSON check would pass it.
    `api.json_guard.body_errors` parses with a hook on every number and then walks the whole
    value: the costliest step of accepting a batch. Almost every line of a real file is plain, and
    for a plain line the walk cannot find anything, for reasons that show in its bytes. One reason
    per refusal of `body_errors`:

    - not UTF-8: the screen decodes the line itself;
    - a lone UTF-16 surrogate or a NUL: JSON text can carry them only as escapes, `\uD800` to
      `\uDFFF` and `\u0000` (strict UTF-8 refuses encoded surrogates, and `json` raw control
      characters), so without those escapes, neither (other escapes, `\u00e9` say, are fine);
    - `NaN`, `Infinity`, `-Infinity`: their names;
    - an integer above 2**64-1 needs 20 digits in a row; a float that overflows to infinity (above
      1.8e308) needs an exponent of three digits or more, or an integer part of over 200 digits
      (fraction digits add no magnitude, and JSON allows no leading zeros);
    - nesting deeper than `max_depth` needs more opening brackets than that.

    A line the screen is unsure of (a prompt that says "NaN", say) simply goes through
    `body_errors`; the screen only ever skips work, it never decides a refusal.
    """
    if raw.count(b"{") + raw.count(b"[") > max_depth or _SUSPECT.search(raw):
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def plain_texts(data: bytes, lines: list[bytes], max_depth: int) -> list[str | None]:
    """`plain_text` of each of `lines`: the complete lines `data` starts with, screened at once.

    Screened alone, each line cost a regex search, the costliest part of the screen: here the
    lines are decoded and searched together, and only a line where a suspect may start
    (`suspect_starts`) is screened on its own.
    """
    end = sum(map(len, lines)) + len(lines)  # the complete lines, each with its newline
    try:
        texts = str(memoryview(data)[:end], "utf-8").split("\n")
    except UnicodeDecodeError:  # some line is not UTF-8: find which, line by line
        return [plain_text(raw, max_depth) for raw in lines]
    starts = suspect_starts(data, end)
    screened: list[str | None] = []
    after = 0  # the offset just past the line's newline
    hit = 0  # the first suspect not before the line
    for raw, text in zip(lines, texts[:-1], strict=True):  # texts[-1]: "" after the last newline
        after += len(raw) + 1
        if hit < len(starts) and starts[hit] < after:  # a suspect in this line: the full screen
            screened.append(plain_text(raw, max_depth))
            while hit < len(starts) and starts[hit] < after:
                hit += 1
        elif text.count("{") + text.count("[") > max_depth:
            screened.append(None)
        else:
            screened.append(text)
    return screened


def suspect_starts(data: bytes, end: int) -> list[int]:
    """Sorted offsets before `end` where a `_SUSPECT` match may start (every one is there).

    Each part of `_SUSPECT` has a fast search of its own: the escapes a regex that starts with a
    literal, the names substrings, and the numbers substrings of `data` with every digit made
    `0`, `E` made `e` and `-` made `+` (`[0-9][eE][-+]?[0-9]{3}` is then `0e000` or `0e+000`,
    and 20 digits twenty `0`s). No match spans a newline, so none spans `end` either.
    """
    starts = [match.start() for match in _SUSPECT_ESCAPE.finditer(data, 0, end)]
    numbers = data.translate(_AS_ZEROS)
    for haystack, needles in ((data, _SUSPECT_NAMES), (numbers, _SUSPECT_NUMBERS)):
        for needle in needles:
            at = haystack.find(needle, 0, end)
            while at >= 0:
                starts.append(at)
                at = haystack.find(needle, at + 1, end)
    return sorted(starts)


CUSTOM_ID_MSG = (
    f"custom_id must be 1-{CUSTOM_ID_MAX} letters, digits, '_' or '-', "
    "starting with a letter or digit"
)


def repeat_error(repeat: Repeat) -> Error:
    """The error of a line whose custom_id an earlier line used."""
    msg = f"duplicate custom_id {repeat.custom_id!r}: first used on line {repeat.first_line}"
    return {"type": "duplicate_custom_id", "loc": ["custom_id"], "msg": msg}


def under(within: tuple[str, ...], error: Error) -> Error:
    """`error` of a line's request, its `loc` from the line (`body` first in OpenAI's form)."""
    return {**error, "loc": [*within, *error["loc"]]} if within else error


def located(number: int, error: Error) -> Error:
    """`error` as the refusal of a file reports it: `loc` from the body, with its line."""
    return {**error, "loc": ["body", "line", number, *error["loc"]], "line": number}


def too_long(limit: int) -> Error:
    """A line over the intake's byte limit."""
    return {"type": "line_too_long", "loc": [], "msg": f"the line is over {limit} bytes"}


def strip_body(error: dict[str, Any]) -> Error:
    """A strict-JSON error of the line (`json_guard`), its `loc` without the leading "body"."""
    loc = list(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    # a line that does not parse says why (json's reason: "Expecting ',' delimiter"), not only that
    reason = (error.get("ctx") or {}).get("error")
    msg = str(reason) if error["type"] == "json_invalid" and reason else error["msg"]
    return {"type": error["type"], "loc": loc, "msg": msg}


def plain_error(error: Any) -> Error:
    """A pydantic error of the line as JSON can carry it."""
    # only what encodes as JSON whatever the input held: type, location, message
    return {"type": str(error["type"]), "loc": list(error["loc"]), "msg": str(error["msg"])}


def drop_repeats(objects: ObjectStore, stored: StoredObject, lines: set[int]) -> StoredObject:
    """Rewrite the committed input `stored` without the items of `lines`, under the same key."""
    writer = open_writer(objects, stored.key, stored.content_type)
    try:
        for raw in iter_lines(objects, stored.key):
            if raw and item_number(raw) not in lines:
                writer.write(raw + b"\n")
        return writer.commit()
    except BaseException:
        writer.abort()
        raise


# --- the stored form of a line: item lines and the jobs' ids ------------------------------


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
