"""An image input that does not decode is refused in words a user reads, not a Python object.

PIL says `cannot identify image file <_io.BytesIO object at 0x7f…>`; the refusal names the input,
what was expected and how the bytes begin (an HTML error page shows as such), from an upload as
from a URL. Real HTTP on 127.0.0.1, a real local object store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.storage.local_store import LocalObjectStore
from kiln.storage.uploaded_inputs import new_upload_id, upload_key
from kiln.tasks.node.image_inputs import ImageInputRejected
from tests.e2e import image_server as served
from tests.tasks.node.test_image_inputs import SCHEMA, fetcher

PAGE = b"<!doctype html><title>404 Not Found</title>"


@pytest.fixture
def objects(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "store")


@pytest.fixture
def images(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # a server that says image/png and sends a web page, and one that sends half a PNG
    monkeypatch.setitem(served.FILES, "/page.png", ("image/png", PAGE))
    monkeypatch.setitem(served.FILES, "/half.png", ("image/png", served.CAT[:60]))
    with served.image_server() as url:
        yield url


def refusal(objects: LocalObjectStore, value: str) -> str:
    with pytest.raises(ImageInputRejected) as refused:
        fetcher(objects).fetch_all({"image": value}, SCHEMA, "key-a")
    message = str(refused.value)
    assert " at 0x" not in message
    assert "BytesIO" not in message
    return message


def test_an_upload_that_is_no_image_says_so_and_how_it_begins(objects: LocalObjectStore) -> None:
    upload_id = new_upload_id()
    objects.put(upload_key("", "key-a", upload_id), PAGE, "image/png")
    assert refusal(objects, f"upload:{upload_id}") == (
        "inputs.image: not a decodable image (PNG, JPEG or WebP): its 43 bytes start "
        "b'<!doctype html><'"
    )


def test_a_url_that_is_no_image_says_so_too(objects: LocalObjectStore, images: str) -> None:
    assert refusal(objects, f"{images}/page.png") == (
        "inputs.image: not a decodable image (PNG, JPEG or WebP): its 43 bytes start "
        "b'<!doctype html><'"
    )


def test_a_truncated_image_says_it_is_truncated(objects: LocalObjectStore, images: str) -> None:
    assert refusal(objects, f"{images}/half.png") == (
        "inputs.image: the image cannot be decoded: image file is truncated"
    )
