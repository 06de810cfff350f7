"""A batch's results: one JSON line per input line, written to the object store in parts.

Parts are listed in Redis as they are committed (`BatchStore.part_keys`): the invalid lines first
(skip_invalid), then the lines of finished jobs as the feeder finds them, the lines ended without
a job (cancel, expiry), and last, once the batch is finished, its summary. Reading them in order
gives every line so far; a finished batch's results hold exactly one line per input line plus the
summary. Output URLs are presigned again when read (those written would expire).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kiln.common.accounting import StepAccounting
from kiln.common.ledger import JobLedger
from kiln.storage.base import dumps
from kiln.storage.batch_store import BatchStore
from kiln.storage.job_store import JobRecord
from kiln.storage.object_streams import iter_lines
from kiln.storage.objects import ObjectStore, StoresByUrl
from kiln.tasks.contract.batches import INVALID, BatchView
from kiln.tasks.contract.views import output_view

# one error of a line, in FastAPI's shape: type, loc (from the line), msg
Error = dict[str, Any]
RESULTS_CONTENT_TYPE = "application/x-ndjson"
_UNFED_MESSAGES = {
    "canceled": "the batch was canceled before this line was fed",
    "expired": "the batch's completion window ended before this line was fed",
}


def _line(data: dict[str, Any]) -> bytes:
    return (dumps(data) + "\n").encode()


def _result(
    line: int,
    custom_id: str | None,
    job_id: str | None,
    status: str,
    *,
    outputs: list[dict[str, Any]] | None = None,
    error: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    accounting: StepAccounting | None = None,
    ledger: JobLedger | None = None,
) -> dict[str, Any]:
    # every line has its job's step accounting and ledger (zeros for a line never a job)
    steps = accounting if accounting is not None else StepAccounting()
    cost = ledger if ledger is not None else JobLedger()
    return {
        "type": "result",
        "line": line,
        "custom_id": custom_id,
        "job_id": job_id,
        "status": status,
        "outputs": outputs or [],
        "error": error,
        "metrics": metrics or {},
        "accounting": steps.model_dump(mode="json"),
        "ledger": cost.model_dump(mode="json"),
    }


def invalid_line(line: int, custom_id: str | None, errors: list[Error]) -> bytes:
    """The result line of an input line refused at submit (skip_invalid)."""
    reasons = "; ".join(
        f"{'.'.join(str(p) for p in error['loc']) or 'line'}: {error['msg']}" for error in errors
    )
    error = {"type": "invalid_line", "message": reasons, "retryable": False, "errors": errors}
    return _line(_result(line, custom_id, None, INVALID, error=error))


def job_line(
    line: int, custom_id: str, job_id: str, record: JobRecord | None, objects: ObjectStore | None
) -> bytes:
    """The result line of a fed line whose job finished (or whose record is gone)."""
    if record is None:
        error = {
            "type": "record_lost",
            "message": "the job's record was gone before its result was written",
            "retryable": False,
        }
        return _line(_result(line, custom_id, job_id, "failed", error=error))
    outputs = [output_view(o, objects).model_dump(mode="json") for o in record.outputs]
    return _line(
        _result(
            line,
            custom_id,
            job_id,
            str(record.state),
            outputs=outputs,
            error=record.error,
            metrics=record.metrics,
            accounting=record.accounting,
            ledger=record.ledger,
        )
    )


def unfed_line(line: int, custom_id: str, reason: str) -> bytes:
    """The result line of a line the batch ended before feeding it (canceled or expired)."""
    error = {"type": reason, "message": _UNFED_MESSAGES[reason], "retryable": False}
    return _line(_result(line, custom_id, None, reason, error=error))


def summary_line(view: BatchView) -> bytes:
    """The last line of a finished batch's results."""
    return _line({"type": "summary", "batch": view.model_dump(mode="json")})


def _fresh_urls(raw: bytes, objects: ObjectStore | None) -> bytes:
    if objects is None or b'"url"' not in raw:
        return raw
    data = json.loads(raw)
    for output in data.get("outputs") or []:
        # a file:// URL was built from where the job's record says it was written; it never
        # expires, and this reader's own store may be another folder
        if not str(output.get("url", "")).startswith("file://"):
            output["url"] = objects.url(str(output["key"]))
    return dumps(data).encode()


def stream_results(
    batches: BatchStore, stores: StoresByUrl, batch_id: str, *, presign: bool = True
) -> Iterator[bytes]:
    """Every result line written so far, in part order (newline-terminated), read as consumed.

    The parts are read from the store the batch's record names; S3 URLs are presigned by this
    process's own.
    """
    source = stores.at(batches.get_fed(batch_id).storage_url)
    objects = stores.own
    for part in batches.part_keys(batch_id):
        for raw in iter_lines(source, part):
            if raw.strip():
                yield _fresh_urls(raw, objects if presign else None) + b"\n"
