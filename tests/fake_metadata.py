"""A fake cloud metadata server (a real HTTP server on 127.0.0.1) for preemption notices.

AWS's spot `instance-action` (404 until a notice, then its JSON document; an IMDSv2 token asked
for with PUT first and required on the GET) and GCE's `preempted` flag (`FALSE`/`TRUE`, only with
`Metadata-Flavor: Google`). Used by tests/tasks/node/test_preemption.py and the e2e drain test.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

AWS_PATH = "/latest/meta-data/spot/instance-action"
GCE_PATH = "/computeMetadata/v1/instance/preempted"
TOKEN = "token-123"


class FakeMetadata:
    """Both clouds' endpoints; `notice` flips them; `aws_body` replaces AWS's document."""

    def __init__(self) -> None:
        self.notice = False
        self.aws_body: bytes | None = None
        self.polls = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                if self.path == "/latest/api/token":
                    self._answer(200, TOKEN.encode())
                else:
                    self.send_error(404)

            def do_GET(self) -> None:
                fake.polls += 1
                status, body = fake.answer(self.path, self.headers.get)
                if status == 200:
                    self._answer(status, body)
                else:
                    self.send_error(status)

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, header: Callable[[str], str | None]) -> tuple[int, bytes]:
        """A GET's status and body, as the cloud's endpoint would answer it."""
        if path == AWS_PATH:
            if header("X-aws-ec2-metadata-token") != TOKEN:
                return 401, b""
            if not self.notice:
                return 404, b""
            document = {"action": "terminate", "time": "2026-12-06T22:10:00Z"}
            return 200, self.aws_body or json.dumps(document).encode()
        if path == GCE_PATH:
            if header("Metadata-Flavor") != "Google":
                return 403, b""
            return 200, b"TRUE" if self.notice else b"FALSE"
        return 404, b""

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()
