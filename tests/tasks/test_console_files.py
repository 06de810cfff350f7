"""The console's files as the API serves them: where, with which headers, and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from kiln.tasks.api.console import CONSOLE_DIR, CONTENT_SECURITY_POLICY
from tests.tasks.helpers import Api


def test_console_is_served_with_its_security_headers(api: Api) -> None:
    with httpx.Client(base_url=api.url) as http:
        bare = http.get("/console")
        assert bare.status_code == 308
        assert bare.headers["location"] == "console/"  # relative: right behind a path prefix
        page = http.get("/console/")
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/html")
        for name in ("console.js", "console.css"):
            asset = http.get(f"/console/{name}")
            assert asset.status_code == 200
            assert asset.content == (CONSOLE_DIR / name).read_bytes()
        for response in (page, asset):
            assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
            assert response.headers["x-content-type-options"] == "nosniff"
            assert response.headers["referrer-policy"] == "no-referrer"
        # the package's Python files are no part of the page
        for other in ("__init__.py", "__pycache__/", "../app.py"):
            assert http.get(f"/console/{other}").status_code == 404, other


def test_the_page_needs_no_inline_code_and_nothing_from_elsewhere() -> None:
    # script-src 'self' forbids inline script and handlers: every script is a file of the folder
    html = (CONSOLE_DIR / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="console.js" defer>']
    assert not re.search(r"\son[a-z]+=", html), "inline event handler"
    assert "style=" not in html
    for path in Path(CONSOLE_DIR).iterdir():
        if path.suffix in {".html", ".js", ".css"}:
            assert not re.search(r"(src|href)=[\"']?(https?:)?//", path.read_text()), path.name
