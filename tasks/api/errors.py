"""Error responses of the HTTP API that cannot fail to encode, whatever the request held.

A 422 echoes the offending input; Starlette's JSON encoder refuses NaN and lone surrogates and
then the 422 became a 500 (and uvicorn dropped the keep-alive connection). Every value here goes
through `json_safe` first, and a response that still fails to render falls back to a constant.
"""

from __future__ import annotations

import errno
import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.storage.errors import StorageError
from kiln.tasks.api.json_guard import MAX_INT, printable
from kiln.tasks.contract.request_check import requested_pipeline, restated_bounds

log = logging.getLogger(__name__)
MAX_ECHO_DEPTH = 8
_FALLBACK_422 = {"detail": [{"type": "value_error", "loc": ["body"], "msg": "Invalid request"}]}
# what a refused batch file gets if its own 422 body cannot be rendered (batch routes)
BATCH_REFUSED_422 = {"detail": [{"type": "batch_invalid", "loc": ["body"], "msg": "Invalid batch"}]}


def _safe_number(value: int | float) -> int | float | str:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, int) and abs(value) > MAX_INT:
        # str() of a huge int raises past 4300 digits; its size is what matters here
        return f"<integer of {value.bit_length()} bits>"
    return value


def json_safe(value: Any, depth: int = 0) -> Any:
    """`value` as plain JSON that encodes: non-finite floats and odd objects become strings."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return _safe_number(value)
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if depth >= MAX_ECHO_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {printable(str(k)): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [json_safe(item, depth + 1) for item in value]
    try:
        return printable(str(value))
    except Exception:  # a value whose str() raises still gets a name
        return type(value).__name__


def safe_json_response(
    content: Any, status_code: int, fallback: Any, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSONResponse of `json_safe(content)`; `fallback` (a constant) if even that fails."""
    try:
        return JSONResponse(json_safe(content), status_code=status_code, headers=headers)
    except Exception:  # the error path must not raise: a raise here is a 500 and a lost connection
        log.exception("could not render a %d response; sent the fallback", status_code)
        return JSONResponse(fallback, status_code=status_code, headers=headers)


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """422 in FastAPI's shape, with every echoed input made encodable."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    if _past_a_bound(request, errors):
        # `width` 100000 names the pipeline's own limit (1024), not the schema's (4096)
        body = getattr(exc, "body", None)
        errors = await run_in_threadpool(_pipeline_bounds, request, errors, body)
    return safe_json_response({"detail": errors}, 422, _FALLBACK_422)


def _past_a_bound(request: Request, errors: Sequence[Any]) -> bool:
    jobs = request.method == "POST" and request.url.path.endswith("/v1/jobs")
    return jobs and any(error.get("type") == "less_than_equal" for error in errors)


def _pipeline_bounds(request: Request, errors: Sequence[Any], body: object) -> list[Any]:
    pipeline = requested_pipeline(body)
    try:
        declared = request.app.state.kiln.submitter.declared(pipeline)  # reads the heartbeats
    except StorageError:  # the schema's own refusal still stands: a 422, not a 503
        return list(errors)
    return restated_bounds(errors, pipeline, declared, prefix=("body",))


async def storage_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    """503 with a fixed message: the cause (hosts, ports, Redis errors) stays in the log."""
    log.warning("job store unavailable: %s", exc)
    return JSONResponse(
        {"detail": "job store unavailable; retry later"},
        status_code=503,
        headers={"Retry-After": "1"},
    )


async def idempotency_conflict(_request: Request, _exc: Exception) -> JSONResponse:
    """409: the key was used before with another body."""
    detail = "Idempotency-Key was already used with a different request body"
    return JSONResponse({"detail": detail}, status_code=409)


# the process (EMFILE) or the system (ENFILE) has no file descriptor left
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
_MAX_CAUSES = 16


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from or groups, is EMFILE or ENFILE."""
    pending, seen = [exc], 0
    while pending and seen < _MAX_CAUSES:
        current = pending.pop()
        seen += 1
        if isinstance(current, OSError) and current.errno in _OUT_OF_DESCRIPTORS:
            return True
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
    return False


class DescriptorExhaustion:
    """ASGI middleware: a request that ran out of file descriptors is a 503, never a 500.

    Wherever the EMFILE/ENFILE came from (a temporary file, a socket to the store, translated
    into a storage error or not), the client is told to retry shortly: descriptors come back as
    other requests end. Once a response has started, the error goes on as before.
    """

    def __init__(self, app: ASGIApp, retry_after_s: int = 1) -> None:
        self.app = app
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the app; answer 503 with Retry-After if it failed for want of descriptors."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as exc:
            if started or not out_of_descriptors(exc):
                raise
            log.warning("out of file descriptors: answered 503 (%s)", exc)
            await self._unavailable(send)

    async def _unavailable(self, send: Send) -> None:
        body = json.dumps({"detail": "server out of file descriptors; retry later"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(self.retry_after_s).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})
