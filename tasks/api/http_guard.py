"""Connection-level limits for `kiln api`: slow clients are cut off, idle ones closed.

uvicorn's only timeout is keep-alive, and every received byte cancels it: a client that opens a
connection and sends nothing, or trickles its headers or body a byte at a time (slowloris), holds
the connection for ever, and an ASGI middleware never sees it (it runs once headers are in). So
the h11 protocol itself gets deadlines: one for the request line and headers, one for the body.
Each is a total, not an idle timer, so trickling does not extend it; both are disarmed once the
request is in, so a long response (an event stream) is never cut.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.tasks.contract.batches import BATCHES_PATH
from kiln.tasks.contract.settings import KilnSettings

log = logging.getLogger(__name__)
REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)
# How long a refused connection is read (and the bytes dropped) after the response went out.
LINGER_S = 2.0


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines (class attributes, seconds)."""

    header_timeout_s = 5.0
    body_timeout_s = 10.0
    # paths whose body is a large upload read while it streams (a batch file): their own deadline
    long_body_timeouts: ClassVar[Mapping[str, float]] = MappingProxyType({})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Start the header deadline at once: a client that says nothing is cut off too."""
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        """Let uvicorn parse, then move the deadline to the request's new phase."""
        if self._lingering:
            return  # the rest of a refused request: read and dropped, never parsed
        super().data_received(data)
        self._watch()

    def send_400_response(self, msg: str) -> None:
        """Refuse a malformed or oversized request line or headers, then close cleanly.

        uvicorn closes at once, while the client may still be sending (a request line longer
        than h11's buffer, say); the unread bytes make the kernel answer with a reset and the
        client never sees the 400. Here the response goes out, our side is shut for writing,
        and what still arrives is read and dropped for a moment before the socket closes.
        """
        text = f"{msg} The request line or headers are malformed or too large.".encode()
        self.transport.write(BAD_REQUEST % (len(text), text))
        self._disarm()
        self._lingering = True
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

    def _current_phase(self) -> str | None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            return "body"
        if state is not h11.IDLE:
            return None  # the request is in (or the connection is ending): the app's turn
        if self.cycle is None or self.conn.trailing_data[0]:
            return "headers"  # a new connection, or part of the next request has arrived
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
        body_timeout = self.body_timeout_s
        if phase == "body" and self.cycle is not None:
            path = str(self.cycle.scope.get("path", ""))
            body_timeout = self.long_body_timeouts.get(path, body_timeout)
        timeouts = {
            "headers": self.header_timeout_s,
            "body": body_timeout,
            "idle": float(self.timeout_keep_alive),
        }
        if phase is not None:
            self._deadline = self.loop.call_later(timeouts[phase], self._expire)

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


def deadline_protocol(settings: KilnSettings) -> type[DeadlineH11Protocol]:
    """The protocol class with `settings`' deadlines (uvicorn instantiates it per connection)."""
    return type(
        "KilnH11Protocol",
        (DeadlineH11Protocol,),
        {
            "header_timeout_s": settings.http_header_timeout_s,
            "body_timeout_s": settings.http_body_timeout_s,
            "long_body_timeouts": MappingProxyType({BATCHES_PATH: settings.batch_body_timeout_s}),
        },
    )


def uvicorn_config(app: Any, settings: KilnSettings, **options: Any) -> uvicorn.Config:
    """Uvicorn's configuration for the API: h11 with deadlines, keep-alive from `settings`."""
    options.setdefault("host", settings.api_host)
    options.setdefault("port", settings.api_port)
    return uvicorn.Config(
        app,
        http=deadline_protocol(settings),
        timeout_keep_alive=settings.http_keepalive_timeout_s,
        **options,
    )
