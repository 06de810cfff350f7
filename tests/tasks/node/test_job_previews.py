"""A job's large previews as stored objects: named by URL while the attempt runs, gone after it.

On both real stores (a local folder, moto S3): a preview over `PREVIEW_INLINE_MAX` is written
under the job's one preview key and replaced by the next one; `close` deletes it, and a preview
encoded after `close` is refused (`PreviewsEnded`, which the progress writer drops) without
writing anything. Small previews never touch the store.
"""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import httpx
import numpy as np
import pytest
from PIL import Image

from kiln.common.previews import PREVIEW_INLINE_MAX
from kiln.storage.local_store import LocalObjectStore
from kiln.storage.objects import ObjectStore, StoredObject, open_object_store
from kiln.storage.settings import StorageSettings
from kiln.tasks.node.previews import JobPreviews, PreviewsEnded

JOB = "job-with-previews"


@pytest.fixture(params=["local", "s3"])
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalObjectStore(tmp_path / "objects")
    settings: StorageSettings = request.getfixturevalue("s3_settings")
    return open_object_store(settings)


def noise(side: int, seed: int) -> np.ndarray:
    """Pixels no codec shrinks much: a PNG of them is about 3 bytes a pixel."""
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def read(url: str) -> bytes:
    """The bytes a client reads from a preview's URL."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).read_bytes()
    answer = httpx.get(url, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.content


def job_keys(objects: ObjectStore) -> list[str]:
    """Every object under the job's folder."""
    folder = f"{objects.prefix}/{JOB}" if objects.prefix else JOB
    return list(objects.list_keys(folder))


def preview_key_of(objects: ObjectStore) -> str:
    return f"{objects.prefix}/{JOB}/preview.png" if objects.prefix else f"{JOB}/preview.png"


def test_a_large_preview_is_stored_replaced_and_deleted_when_the_attempt_ends(
    objects: ObjectStore,
) -> None:
    previews = JobPreviews(objects, JOB, "png")
    first = previews.payload(1, 4, noise(256, 1))
    assert first.image_b64 is None
    assert first.url is not None
    assert len(read(first.url)) > PREVIEW_INLINE_MAX
    second = previews.payload(2, 4, noise(256, 2))
    # one object per job, replaced: the first URL now reads the second preview
    assert job_keys(objects) == [preview_key_of(objects)]
    assert second.url is not None
    with Image.open(io.BytesIO(read(second.url))) as image:
        assert (image.format, image.size) == ("PNG", (256, 256))
        assert np.array_equal(np.asarray(image), noise(256, 2))
    previews.close()
    assert job_keys(objects) == []
    with pytest.raises(PreviewsEnded):
        previews.payload(3, 4, noise(256, 3))
    assert job_keys(objects) == []


def test_an_attempt_that_lost_its_lease_leaves_the_new_holders_preview(
    objects: ObjectStore,
) -> None:
    lost = JobPreviews(objects, JOB, "png")
    lost.payload(1, 4, noise(256, 1))
    holder = JobPreviews(objects, JOB, "png")
    holder.payload(1, 4, noise(256, 2))
    lost.close(delete=False)
    assert job_keys(objects) == [preview_key_of(objects)]
    holder.close()
    assert job_keys(objects) == []


def test_small_previews_ride_inline_and_store_nothing(objects: ObjectStore) -> None:
    previews = JobPreviews(objects, JOB, "webp")
    payload = previews.payload(1, 2, noise(8, 1))
    assert payload.url is None
    assert payload.image_b64 is not None
    with Image.open(io.BytesIO(base64.b64decode(payload.image_b64))) as image:
        assert (image.format, image.size) == ("WEBP", (8, 8))
    previews.close()
    assert previews.payload(2, 2, noise(8, 2)).image_b64  # inline: nothing to store or delete
    assert job_keys(objects) == []


def test_a_preview_being_stored_while_the_attempt_ends_is_deleted_after_it(tmp_path: Path) -> None:
    """`close` waits for a put in progress, then deletes: no object outlives the attempt."""
    entered, release = threading.Event(), threading.Event()

    class SlowStore(LocalObjectStore):
        def put(
            self,
            key: str,
            data: bytes,
            content_type: str,
            metadata: dict[str, str] | None = None,
            *,
            create_only: bool = False,
        ) -> StoredObject:
            entered.set()
            assert release.wait(10)
            return super().put(key, data, content_type, metadata, create_only=create_only)

    objects = SlowStore(tmp_path / "objects")
    previews = JobPreviews(objects, JOB, "png")
    writer = threading.Thread(target=previews.payload, args=(1, 4, noise(256, 1)))
    writer.start()
    assert entered.wait(10)
    closer = threading.Thread(target=previews.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # held back by the put in progress
    release.set()
    writer.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert job_keys(objects) == []
