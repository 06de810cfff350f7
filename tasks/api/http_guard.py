"""Connection-level limits for `kiln api`: slow clients are cut off, idle ones closed.

uvicorn's only timeout is keep-alive, and every received byte cancels it: a client that opens a
connection and sends nothing, or trickles its headers or body a byte at a time (slowloris), holds
the connection for ever, and an ASGI middleware never sees it (it runs once headers are in). So
the HTTP protocol itself gets deadlines: one for the request line and headers, one for the body.
Each is a total, not an idle timer, so trickling does not extend it; both are disarmed once the
request is in, so a long response (an event stream) is never cut.

The protocol is uvicorn's httptools one (llhttp, in C) on uvloop: h11, uvicorn's pure-Python
parser, and the asyncio loop took about a fifth of the API's CPU, and this pair serves a job
submission on 10-15% less. The request's phase comes from the parser's callbacks (message begin,
headers complete, message complete).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kiln.tasks.contract.batches import BATCHES_PATH
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.contract.upload_slots import LOCAL_PUT_PATH

log = logging.getLogger(__name__)
Phase = Literal["headers", "body", "idle"]
REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
# How long a refused connection is read (and the bytes dropped) after the response went out.
LINGER_S = 2.0


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines (class attributes, seconds)."""

    header_timeout_s = 5.0
    body_timeout_s = 10.0
    # paths whose body is a large upload read while it streams (a batch file): their own deadline
    long_body_timeouts: ClassVar[Mapping[str, float]] = MappingProxyType({})
    # a request line and headers still incomplete past this many bytes: 400 (llhttp has no limit
    # of its own; h11's buffer had this one, and as there a head whole in one read is not counted)
    max_head_bytes = 16 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: Phase | None = None
        self._reading: Literal["headers", "body"] | None = None  # the parser's place in a request
        self._head_bytes = 0
        self._message_ended = False
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the header deadline at once: a client that says nothing is cut off too."""
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        """Let uvicorn parse, bound a head still arriving, move the deadline to the new phase."""
        if self._lingering:
            return  # the rest of a refused request: read and dropped, never parsed
        self._message_ended = False
        super().data_received(data)
        if self._lingering:
            return
        if self._reading == "headers" and not self._message_ended:
            # no earlier request ended in this chunk: all of it is the head still arriving
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                log.info("refusing a request: line and headers past %d bytes", self.max_head_bytes)
                self.send_400_response("Invalid HTTP request received.")
                return
        self._watch()

    def on_message_begin(self) -> None:
        """A request starts: its head is read."""
        super().on_message_begin()
        self._reading, self._head_bytes = "headers", 0

    def on_headers_complete(self) -> None:
        """The head is in: its body (if any) is read."""
        super().on_headers_complete()
        self._reading = "body"

    def on_message_complete(self) -> None:
        """The request is in: its deadline ends (a next one in the same bytes gets its own)."""
        super().on_message_complete()
        self._reading, self._message_ended = None, True
        self._disarm()

    def send_400_response(self, msg: str) -> None:
        """Refuse a malformed or oversized request, then close cleanly.

        uvicorn closes at once, while the client may still be sending (a request line longer
        than the limit, say); the unread bytes make the kernel answer with a reset and the
        client never sees the 400. Here the response goes out, our side is shut for writing,
        and what still arrives is read and dropped for a moment before the socket closes.
        """
        self._disarm()
        self._lingering = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # bad bytes under a request still in play (a broken chunked body, or garbage pipelined
            # behind it): its app reads a disconnect and what it sends is dropped
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started or self.pipeline:
                self.transport.close()  # a response is under way: a 400 would land inside it
                return
        text = f"{msg} The request line or headers are malformed or too large.".encode()
        self.transport.write(BAD_REQUEST % (len(text), text))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def on_response_complete(self) -> None:
        """A pipelined or still-uploading request may be left half-read: watch it."""
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        """No deadline outlives its connection."""
        self._disarm()
        super().connection_lost(exc)

    def _current_phase(self) -> Phase | None:
        if self.pipeline:
            return None  # a request waits (reading paused) behind a response: its turn starts later
        if self._reading == "body":
            return "body"  # while it streams, even past an early response (a 413 drains it)
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # the request is in: the app's turn (a next head waits for the response)
        if self._reading == "headers" or self.cycle is None:
            return "headers"  # a new connection, or the next request has begun
        # idle between requests: uvicorn's keep-alive timer covers it, unless a byte that was
        # no request (or a drained body) cancelled that timer and nothing re-armed it
        return "idle" if self.timeout_keep_alive_task is None else None

    def _watch(self) -> None:
        if self.transport.is_closing():
            self._disarm()
            return
        phase = self._current_phase()
        if phase == self._phase:
            return  # same phase: the deadline runs on (a trickle must not extend it)
        self._disarm()
        self._phase = phase
        if phase == "headers":
            timeout = self.header_timeout_s
        elif phase == "body":
            path = str(self.scope.get("path", ""))
            timeout = self.long_body_timeouts.get(path, self.body_timeout_s)
        elif phase == "idle":
            timeout = float(self.timeout_keep_alive)
        else:
            return
        self._deadline = self.loop.call_later(timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._phase = None

    def _expire(self) -> None:
        phase, self._deadline = self._phase, None
        if self.transport.is_closing():
            return
        log.info("closing a connection: request %s not received in time", phase)
        responding = self.cycle is not None and self.cycle.response_started
        if phase == "headers" or (phase == "body" and not responding):
            self.transport.write(REQUEST_TIMEOUT)
        if self.cycle is not None and not self.cycle.response_complete:
            # the app may still be waiting for the body: it now reads a disconnect, and any
            # response it sends is dropped instead of following the 408
            self.cycle.disconnected = True
        self.transport.close()


def deadline_protocol(settings: KilnSettings) -> type[DeadlineProtocol]:
    """The protocol class with `settings`' deadlines (uvicorn instantiates it per connection)."""
    return type(
        "KilnHttpProtocol",
        (DeadlineProtocol,),
        {
            "header_timeout_s": settings.http_header_timeout_s,
            "body_timeout_s": settings.http_body_timeout_s,
            # a batch file and an upload to a local store stream large bodies
            "long_body_timeouts": MappingProxyType(
                {
                    BATCHES_PATH: settings.batch_body_timeout_s,
                    LOCAL_PUT_PATH: settings.batch_body_timeout_s,
                }
            ),
        },
    )


def uvicorn_config(app: Any, settings: KilnSettings, **options: Any) -> uvicorn.Config:
    """Uvicorn's configuration for the API: httptools with deadlines, uvloop, keep-alive."""
    options.setdefault("host", settings.api_host)
    options.setdefault("port", settings.api_port)
    options.setdefault("loop", "uvloop")
    return uvicorn.Config(
        app,
        http=deadline_protocol(settings),
        timeout_keep_alive=settings.http_keepalive_timeout_s,
        **options,
    )
