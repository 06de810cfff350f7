"""Images for the image-input tests: random PNGs, and an HTTP server on 127.0.0.1 serving them."""

from __future__ import annotations

import http.server
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from PIL import Image


def png(seed: int, size: tuple[int, int], mode: str = "RGB") -> bytes:
    """A PNG of random pixels (or a half-white mask for mode L)."""
    width, height = size
    if mode == "L":
        pixels = np.zeros((height, width), dtype=np.uint8)
        pixels[:, width // 2 :] = 255
    else:
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode).save(buffer, "PNG")
    return buffer.getvalue()


CAT, DOG, MASK = png(1, (80, 48)), png(2, (80, 48)), png(0, (64, 96), "L")
FILES = {
    "/cat.png": ("image/png", CAT),
    "/dog.png": ("image/png", DOG),
    "/mask.png": ("image/png", MASK),
    "/cat.txt": ("text/plain", CAT),
}


class ImageHandler(http.server.BaseHTTPRequestHandler):
    """Serves FILES (content type as listed); 404 for anything else."""

    def do_GET(self) -> None:
        """Answer one GET."""
        content_type, body = FILES.get(self.path, ("text/plain", b""))
        self.send_response(200 if self.path in FILES else 404)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@contextmanager
def image_server() -> Iterator[str]:
    """Serve FILES on 127.0.0.1 (a free port); yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
