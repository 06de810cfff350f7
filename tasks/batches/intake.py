"""Accepting a batch file: every line validated as it streams past, valid ones stored normalized.

`BatchIntake` takes the body in chunks of any size (`feed`), never more than one line at a time
beyond the chunk it holds, and writes each valid line to the batch's input object through a
streamed writer (`storage.object_streams`). A line must be a JSON object: a job request (the same
rules as POST /v1/jobs: strict JSON, the schema, a known pipeline, its limits, the webhook rules)
plus a `custom_id` unique in the file. Lines without `pipeline` or `priority` take the batch's
defaults. Blank lines are skipped (they still count for line numbers).

Without `skip_invalid` one invalid line refuses the whole file: the report carries the first
errors (line number, field, reason) and the total count, and the caller aborts the writer. With
it, each invalid line becomes an `invalid` result line of its own.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kiln.storage.object_base import StoredObject
from kiln.storage.object_streams import ObjectWriter
from kiln.tasks.batches.checks import Error, LineChecks
from kiln.tasks.batches.lines import item_line
from kiln.tasks.batches.results import invalid_line
from kiln.tasks.contract.batches import CUSTOM_ID_MAX, valid_custom_id
from kiln.tasks.contract.schemas import DRAWN_SEED_LIMIT, JobRequest

# Strict-JSON errors of one line (the API's `json_guard.body_errors`): loc starts with "body".
JsonCheck = Callable[[bytes], list[dict[str, Any]]]
MAX_ERRORS_SHOWN = 20
# far above any valid request (4000-char prompts, 16 metadata entries, a 2 KiB webhook URL)
DEFAULT_MAX_LINE_BYTES = 256 * 1024
_CUSTOM_ID_MSG = (
    f"custom_id must be 1-{CUSTOM_ID_MAX} letters, digits, '_' or '-', "
    "starting with a letter or digit"
)


@dataclass(frozen=True)
class LineDefaults:
    """What a batch gives every line that does not say otherwise.

    `pipeline`, `priority` and `webhook` fill a line's missing field; `metadata` entries are added
    to a line's own (the line's win).
    """

    pipeline: str | None = None
    priority: str = "bulk"
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
    """

    def __init__(
        self,
        *,
        checks: LineChecks,
        json_errors: JsonCheck,
        items: ObjectWriter,
        invalid: ObjectWriter | None = None,
        defaults: LineDefaults | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    ) -> None:
        self.checks = checks
        self.json_errors = json_errors
        self.items = items
        self.invalid = invalid
        self.defaults = defaults or LineDefaults()
        self.max_line_bytes = max_line_bytes
        self.report = IntakeReport()
        self._number = 0  # physical line number of the last line seen
        self._rest = b""
        self._overlong = False  # the line being read is past max_line_bytes: skip to its end
        self._seen: dict[bytes, int] = {}  # digest of each custom_id -> its line

    @property
    def skip_invalid(self) -> bool:
        """Whether invalid lines become results instead of refusing the file."""
        return self.invalid is not None

    def feed(self, chunk: bytes) -> None:
        """Take the next chunk of the body (any size; lines may span chunks)."""
        parts = (self._rest + chunk).split(b"\n")
        self._rest = parts.pop()
        for raw in parts:
            self._line(raw)
        if len(self._rest) > self.max_line_bytes:
            if not self._overlong:
                self._refuse(self._number + 1, None, [_too_long(self.max_line_bytes)])
            self._overlong, self._rest = True, b""

    def finish(self) -> IntakeReport:
        """The last line (without a final newline), then the report; commits what was written.

        A refused file's objects are left to the caller to abort (nothing is committed).
        """
        if self._rest or self._overlong:
            self._line(self._rest)
            self._rest = b""
        report = self.report
        if report.lines == 0:
            report.errors.append(
                {"type": "batch_empty", "loc": ["body"], "msg": "the batch has no lines", "line": 0}
            )
        elif report.items == 0:  # skip_invalid, every line invalid: nothing would ever run
            msg = f"no valid line: all {report.invalid} lines are invalid"
            report.errors.append({"type": "batch_no_valid_lines", "loc": ["body"], "msg": msg,
                                  "line": 0})
        if report.refused:
            return report
        report.items_object = self.items.commit()
        if self.invalid is not None and report.invalid:
            report.invalid_object = self.invalid.commit()
        return report

    def abort(self) -> None:
        """Drop everything written (a refused or interrupted upload)."""
        self.items.abort()
        if self.invalid is not None:
            self.invalid.abort()

    def _line(self, raw: bytes) -> None:
        self._number += 1
        if self._overlong:  # the end of a line already refused as too long
            self._overlong = False
            return
        if len(raw) > self.max_line_bytes:
            self._refuse(self._number, None, [_too_long(self.max_line_bytes)])
            return
        if not raw.strip():
            return
        custom_id, outcome = self._validate(raw)
        if isinstance(outcome, list):
            self._refuse(self._number, custom_id, outcome)
            return
        assert custom_id is not None
        self.report.items += 1
        if not self.report.errors:  # a refused file writes nothing more
            self.items.write(item_line(self._number, custom_id, outcome.model_dump(mode="json")))

    def _validate(self, raw: bytes) -> tuple[str | None, JobRequest | list[Error]]:
        json_problems = self.json_errors(raw)
        if json_problems:
            return None, [_strip_body(error) for error in json_problems]
        data = json.loads(raw)
        if not isinstance(data, dict):
            return None, [{"type": "dict_type", "loc": [], "msg": "a line must be a JSON object"}]
        custom_id = data.pop("custom_id", None)
        if custom_id is None:
            return None, [{"type": "missing", "loc": ["custom_id"], "msg": "Field required"}]
        if not valid_custom_id(custom_id):
            return None, [{"type": "custom_id", "loc": ["custom_id"], "msg": _CUSTOM_ID_MSG}]
        first = self._first_use(custom_id)
        if first is not None:
            msg = f"duplicate custom_id {custom_id!r}: first used on line {first}"
            return custom_id, [{"type": "duplicate_custom_id", "loc": ["custom_id"], "msg": msg}]
        self.defaults.apply(data)
        try:
            request = JobRequest.model_validate(data)
        except ValidationError as exc:
            return custom_id, [_plain(error) for error in exc.errors()]
        problems = self.checks.errors(request)
        if problems:
            return custom_id, problems
        if request.seed is None:  # drawn once, stored: a line fed again makes the same job
            request = request.model_copy(update={"seed": random.randrange(DRAWN_SEED_LIMIT)})
        return custom_id, request

    def _first_use(self, custom_id: str) -> int | None:
        digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
        first = self._seen.get(digest)
        if first is None:
            self._seen[digest] = self._number
        return first

    def _refuse(self, number: int, custom_id: str | None, errors: list[Error]) -> None:
        report = self.report
        report.invalid += 1
        if self.invalid is not None:
            self.invalid.write(invalid_line(number, custom_id, errors))
            return
        for error in errors:
            if len(report.errors) < MAX_ERRORS_SHOWN:
                report.errors.append(
                    {**error, "loc": ["body", "line", number, *error["loc"]], "line": number}
                )


def _too_long(limit: int) -> Error:
    return {"type": "line_too_long", "loc": [], "msg": f"the line is over {limit} bytes"}


def _strip_body(error: dict[str, Any]) -> Error:
    loc = list(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    return {"type": error["type"], "loc": loc, "msg": error["msg"]}


def _plain(error: Any) -> Error:
    # only what encodes as JSON whatever the input held: type, location, message
    return {"type": str(error["type"]), "loc": list(error["loc"]), "msg": str(error["msg"])}
