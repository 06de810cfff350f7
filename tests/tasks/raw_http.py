"""A raw HTTP/1.1 client on one socket: every byte is the test's, and reuse is visible.

httpx and http.client validate what they send and quietly open a new connection when the server
closed the old one; these tests need the opposite: odd bytes on the wire, and a failure when the
server dropped the connection they are reusing.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any


def strict_json(body: bytes) -> Any:
    """Parse a response as standard JSON: UTF-8, no NaN or Infinity."""

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response")

    return json.loads(body.decode("utf-8"), parse_constant=refuse)


@dataclass
class RawResponse:
    """One parsed response."""

    status: int
    headers: dict[str, str]
    body: bytes
    will_close: bool


class RawConnection:
    """One keep-alive connection to 127.0.0.1:`port`."""

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        """Write bytes as they are."""
        self.sock.sendall(data)

    def request(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes | None = None,
    ) -> RawResponse:
        """Send one request (Content-Length added for a body) and read its response."""
        lines = [method.encode() + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1"]
        lines += [name + b": " + value for name, value in headers or []]
        if body is not None:
            lines.append(b"Content-Length: " + str(len(body)).encode())
        self.send(b"\r\n".join(lines) + b"\r\n\r\n" + (body or b""))
        return self.read_response()

    def read_response(self) -> RawResponse:
        """Read one whole response (raises if the server closed the connection instead)."""
        response = http.client.HTTPResponse(self.sock)
        response.begin()
        body = response.read()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return RawResponse(response.status, headers, body, bool(response.will_close))

    def wait_closed(self, timeout: float) -> tuple[bool, bytes]:
        """Read until the server closes (True) or `timeout` passes (False); returns what came."""
        received = b""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return True, received
            if not chunk:
                return True, received
            received += chunk
        return False, received

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()
