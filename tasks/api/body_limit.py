"""ASGI middleware that answers 413 to request bodies over a size limit, before any parsing.

The 413 does not close the connection: closing with unread upload data in the socket makes the
kernel send a reset, and a client still uploading (httpx sends the whole body before it reads)
then sees "connection reset" instead of the 413. Left open, uvicorn discards the rest of the body
(it drops body data once the response is complete), the client reads the 413, and the connection
serves the next request. `api.http_guard`'s body deadline bounds how long that drain may take.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.tasks.api.deps import json_error_docs

# methods whose bodies the limit lets through unread (uvicorn passes a GET's body on; no route
# here reads one)
BODILESS = ("GET", "HEAD", "OPTIONS")


class BodySizeLimit:
    """Refuses bodies over `max_bytes` (declared or streamed) with 413; buffers the rest.

    `streamed` maps paths whose route reads its body as a stream (a batch file: far larger than
    memory) to their own limit: a larger declared length is a 413 here, and the body passes
    through unbuffered; the route counts what it reads against the same limit.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, streamed: Mapping[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.streamed = dict(streamed or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass through non-HTTP and body-less requests; read and check the body otherwise."""
        if scope["type"] != "http" or scope["method"] in BODILESS:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        streamed_limit = self.streamed.get(scope.get("path", ""))
        if streamed_limit is not None:
            if declared is not None and declared.isdigit() and int(declared) > streamed_limit:
                await self._too_large(send, streamed_limit)
                return
            await self.app(scope, receive, send)
            return
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send)
            return
        # Bodies are small (the limit is tens of KiB): buffering them whole keeps the count exact
        # for chunked uploads that declare no length.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send, limit: int | None = None) -> None:
        body = json.dumps({"detail": too_large_detail(limit or self.max_bytes)}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def document_too_large(app: FastAPI) -> None:
    """Name the limit's 413 in the OpenAPI document for every operation it applies to.

    The middleware answers it before any route runs, to any method that may carry a body, so
    each route's own `responses` would have to repeat it (they did not: a fuzzer's oversized body
    to `POST /v1/dead-letters/redrive` got an undocumented 413). FastAPI's way to add to the
    generated document is to wrap `app.openapi`, which builds it once and caches it.
    """
    build = app.openapi
    too_large = json_error_docs(413)[413]

    def openapi() -> dict[str, Any]:
        fresh = app.openapi_schema is None
        schema = build()  # built on the first call, FastAPI's cached copy after
        if fresh:
            for operations in schema["paths"].values():
                for method, operation in operations.items():
                    if method.upper() not in BODILESS:
                        operation["responses"].setdefault("413", too_large)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def too_large_detail(limit: int) -> str:
    """The `detail` of a 413."""
    return f"request body is over {limit} bytes"


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
