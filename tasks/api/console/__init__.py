"""The console page (`/console`): static HTML, CSS and JavaScript that speak the public API.

The files beside this module are served as they are (no build step, nothing from elsewhere), with
a Content-Security-Policy that lets the page run only its own script and style and talk only to
its own origin; output images may come from the object store's (presigned) URLs.
See docs/console.md.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

CONSOLE_PATH = "/console"
CONSOLE_DIR = Path(__file__).resolve().parent
# The page's own script and style only (no inline code), API calls to its own origin; outputs and
# previews load from the object store (any origin) or from data: URLs.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data: blob: http: https:; media-src 'self' data: blob: http: https:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # presigned output URLs must not leak through Referer
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidated (ETag): a new version shows on the next load
}
SERVED_SUFFIXES = frozenset({".html", ".js", ".css"})


class ConsoleFiles(StaticFiles):
    """The console's files, each with the security headers; nothing else in the folder."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        """The file (index.html for the folder itself) with the console's headers."""
        if path not in (".", "") and Path(path).suffix not in SERVED_SUFFIXES:
            response: Response = Response("Not Found", status_code=404, media_type="text/plain")
        else:
            response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


async def _to_folder(_request: Request) -> Response:
    # relative: right behind a proxy that serves the API under a path prefix, too
    return RedirectResponse("console/", status_code=308)


def mount_console(app: FastAPI) -> None:
    """Serve the console at /console/ (and /console, redirected there)."""
    app.add_route(CONSOLE_PATH, _to_folder, methods=["GET", "HEAD"], include_in_schema=False)
    app.mount(CONSOLE_PATH, ConsoleFiles(directory=CONSOLE_DIR, html=True), name="console")
