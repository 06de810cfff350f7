"""The node's fetch of image inputs: the SSRF guard, the limits, the owner's uploads, the facts.

Real HTTP on 127.0.0.1 (tests/e2e/image_server.py), a real local object store, the real guard.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from kiln.common.request import InputValue
from kiln.gpu_worker.images import InputImage
from kiln.gpu_worker.protocol import GenerationRequest
from kiln.storage.local_store import LocalObjectStore
from kiln.storage.uploaded_inputs import new_upload_id, upload_key
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.node.image_inputs import ImageFetcher, ImageInputRejected, with_images
from tests.e2e.image_server import CAT, FILES, image_server

SCHEMA: dict[str, Any] = {
    "properties": {
        "image": {"type": "string", "x-kiln-image": True},
        "mask_image": {"type": "string", "x-kiln-image": True},
        "strength": {"type": "number"},
    }
}
ALLOWED = {"input_allow_http": True, "input_allow_hosts": ["127.0.0.1"]}


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    with image_server() as url:
        yield url


@pytest.fixture
def objects(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "store")


def fetcher(objects: LocalObjectStore, **settings: Any) -> ImageFetcher:
    return ImageFetcher(objects, KilnSettings(**{**ALLOWED, **settings}))


def rejection(fetch: ImageFetcher, inputs: dict[str, Any], owner: str | None = None) -> str:
    with pytest.raises(ImageInputRejected) as refused:
        fetch.fetch_all(inputs, SCHEMA, owner)
    return str(refused.value)


def test_an_allow_listed_url_and_an_own_upload_are_fetched_and_described(
    objects: LocalObjectStore, images: str
) -> None:
    upload_id = new_upload_id()
    objects.put(upload_key("", "key-a", upload_id), FILES["/mask.png"][1], "image/png")
    inputs: dict[str, InputValue] = {
        "image": f"{images}/cat.png", "mask_image": f"upload:{upload_id}", "strength": 0.5,
    }  # fmt: skip
    fetched = fetcher(objects).fetch_all(inputs, SCHEMA, "key-a")
    assert fetched["image"].facts() == {
        "sha256": hashlib.sha256(CAT).hexdigest(), "width": 80, "height": 48, "bytes": len(CAT),
        "content_type": "image/png", "source": f"{images}/cat.png",
    }  # fmt: skip
    assert fetched["mask_image"].facts()["source"] == f"upload:{upload_id}"
    request = GenerationRequest(
        request_id="r", pipeline="p", prompt="x", width=64, height=64, steps=2, seed=1,
        guidance_scale=5.0, extra_inputs=inputs,
    )  # fmt: skip
    carried = with_images(request, fetched)
    image = carried.images["image"]
    assert carried.extra_inputs["image"] == f"sha256:{image.sha256}"  # the batch key's part
    assert carried.extra_inputs["strength"] == 0.5
    assert image.to_pil((64, 64)).size == (64, 64)


def test_the_guard_refuses_a_local_url_without_the_allow_list(
    objects: LocalObjectStore, images: str
) -> None:
    strict = ImageFetcher(objects, KilnSettings(input_allow_http=True))
    message = rejection(strict, {"image": f"{images}/cat.png"})
    assert message.startswith("inputs.image: '127.0.0.1' resolves to 127.0.0.1, which is")
    assert "https" in rejection(ImageFetcher(objects, KilnSettings()), {"image": "http://x.org/a"})


@pytest.mark.parametrize(
    ("path", "settings", "message"),
    [
        ("/cat.txt", {}, "is 'text/plain'; allowed: image/jpeg, image/png, image/webp"),
        ("/none.png", {}, "answered HTTP 404"),
        ("/cat.png", {"upload_max_bytes": 1024}, "is over the limit of 1024 bytes"),
        ("/mask.png", {"input_max_pixels": 64 * 64}, "the image is 64x96 pixels, over the limit"),
    ],
)
def test_urls_over_the_limits_or_of_the_wrong_type_are_refused(
    objects: LocalObjectStore, images: str, path: str, settings: dict[str, Any], message: str
) -> None:
    assert message in rejection(fetcher(objects, **settings), {"image": f"{images}{path}"})


def test_uploads_of_another_owner_or_not_images_are_refused(objects: LocalObjectStore) -> None:
    upload_id = new_upload_id()
    objects.put(upload_key("", "key-a", upload_id), CAT, "image/png")
    fetch = fetcher(objects)
    assert "no such upload for this API key" in rejection(
        fetch, {"image": f"upload:{upload_id}"}, "key-b"
    )
    corrupt, gif = new_upload_id(), new_upload_id()
    objects.put(upload_key("", "key-a", corrupt), CAT[:60], "image/png")
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "GIF")
    objects.put(upload_key("", "key-a", gif), buffer.getvalue(), "image/png")
    assert "cannot be decoded" in rejection(fetch, {"image": f"upload:{corrupt}"}, "key-a")
    assert "the image is GIF, not PNG/JPEG/WebP" in rejection(
        fetch, {"image": f"upload:{gif}"}, "key-a"
    )


def test_an_input_image_decodes_to_the_same_pixels_anywhere() -> None:
    image = InputImage(hashlib.sha256(CAT).hexdigest(), CAT, 80, 48)
    assert image.to_pil().tobytes() == Image.open(io.BytesIO(CAT)).convert("RGB").tobytes()
