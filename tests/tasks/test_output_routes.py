"""`GET /v1/jobs/{id}/outputs/{n}`: a job's output served to its owner over real HTTP.

From the store its record names (a local folder, or S3 on a moto server), whole or one range.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.storage.job_store import JobStore
from kiln.storage.objects import LocalObjectStore, ObjectStore, new_attempt_name, output_key
from kiln.storage.settings import StorageSettings
from kiln.tasks.contract.views import with_storage_url
from tests.tasks.helpers import Api, ApiFactory, queued_job, start_job

# bytes that are not all alike, so that a wrong range shows
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
MP4 = b"\x00\x00\x00\x18ftypmp42" + secrets.token_bytes(300_000)


def finished_job(
    store: JobStore,
    objects: ObjectStore,
    storage_url: str,
    files: list[tuple[bytes, str, str]],
    owner: str | None,
) -> str:
    """A succeeded job whose outputs (data, content type, extension) are stored in `objects`."""
    job_id = queued_job(store, owner=owner)
    token = start_job(store, job_id)
    attempt = new_attempt_name(token)
    outputs: list[dict[str, Any]] = []
    for index, (data, content_type, ext) in enumerate(files):
        key = output_key(objects.prefix, job_id, index, ext, attempt=attempt)
        objects.put(key, data, content_type)
        outputs.append(
            {
                "key": key,
                "content_type": content_type,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    store.succeed(job_id, token, with_storage_url(outputs, storage_url), {"queue_s": 0.1})
    store.release_lease(job_id, token)
    return job_id


def local_job(api: Api, files: list[tuple[bytes, str, str]], owner: str = "alice") -> str:
    assert api.ctx.objects is not None
    url = api.storage_settings.storage_url
    return finished_job(api.store, api.ctx.objects, url, files, api.key_ids[owner])


def output_url(api: Api, job_id: str, index: int | str) -> str:
    return f"{api.url}/v1/jobs/{job_id}/outputs/{index}"


def test_the_owner_gets_the_output_whole_with_its_type_length_and_etag(api: Api) -> None:
    job_id = local_job(api, [(PNG, "image/png", "png"), (MP4, "video/mp4", "mp4")])
    got = httpx.get(output_url(api, job_id, 0), headers=api.auth("alice"))
    assert got.status_code == 200, got.text
    assert got.content == PNG
    assert got.headers["content-type"] == "image/png"
    assert got.headers["content-length"] == str(len(PNG))
    assert got.headers["accept-ranges"] == "bytes"
    assert got.headers["etag"] == f'"{hashlib.sha256(PNG).hexdigest()}"'
    assert got.headers["content-disposition"] == f'inline; filename="{job_id}-0.png"'
    video = httpx.get(output_url(api, job_id, 1), headers=api.auth("alice"))
    assert (video.status_code, video.headers["content-type"]) == (200, "video/mp4")
    assert video.content == MP4
    # the same ETag again: nothing is sent
    again = httpx.get(
        output_url(api, job_id, 0),
        headers={**api.auth("alice"), "If-None-Match": got.headers["etag"]},
    )
    assert (again.status_code, again.content) == (304, b"")
    head = httpx.head(output_url(api, job_id, 1), headers=api.auth("alice"))
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == str(len(MP4))


def test_only_the_owner_and_admins_get_it_and_unknown_ids_and_indexes_are_404(api: Api) -> None:
    job_id = local_job(api, [(PNG, "image/png", "png")])
    url = output_url(api, job_id, 0)
    assert httpx.get(url).status_code == 401
    other = httpx.get(url, headers=api.auth("bob"))
    assert other.status_code == 403, other.text
    assert "another API key" in other.json()["detail"]
    assert httpx.get(url, headers=api.auth("admin")).content == PNG
    for index, status in (("1", 404), (str(10**30), 404), ("-1", 422), ("x", 422), ("1e3", 422)):
        got = httpx.get(output_url(api, job_id, index), headers=api.auth("alice"))
        assert got.status_code == status, (index, got.text)
    past = httpx.get(output_url(api, job_id, 3), headers=api.auth("alice"))
    assert past.json()["detail"] == f"job {job_id} has 1 output(s), 0 to 0; no 3"
    unknown = httpx.get(output_url(api, "f" * 32, 0), headers=api.auth("alice"))
    assert unknown.status_code == 404
    hostile = httpx.get(output_url(api, "..%2F..%2Fetc", 0), headers=api.auth("alice"))
    assert hostile.status_code == 404
    queued = queued_job(api.store, owner=api.key_ids["alice"])
    none_yet = httpx.get(output_url(api, queued, 0), headers=api.auth("alice"))
    assert none_yet.status_code == 404
    assert none_yet.json()["detail"] == f"job {queued} has no outputs (status queued)"


def test_an_output_deleted_from_its_store_is_a_404_saying_so(api: Api) -> None:
    job_id = local_job(api, [(PNG, "image/png", "png")])
    assert api.ctx.objects is not None
    api.ctx.objects.delete(api.store.get(job_id).outputs[0]["key"])
    got = httpx.get(output_url(api, job_id, 0), headers=api.auth("alice"))
    assert got.status_code == 404
    assert got.json()["detail"] == f"output 0 of job {job_id} is no longer stored"


@pytest.mark.parametrize(
    ("header", "start", "stop"),
    [
        ("bytes=0-9", 0, 10),
        ("bytes=100-", 100, None),
        ("bytes=-7", -7, None),
        ("bytes=1000-99999999", 1000, None),  # an end past the object: up to its end
        ("Bytes = 5-5", 5, 6),
    ],
)
def test_one_byte_range_is_a_206_with_its_content_range(
    api: Api, header: str, start: int, stop: int | None
) -> None:
    job_id = local_job(api, [(PNG, "image/png", "png")])
    got = httpx.get(output_url(api, job_id, 0), headers={**api.auth("alice"), "Range": header})
    assert got.status_code == 206, got.text
    expected = PNG[start:stop]
    assert got.content == expected
    first = start % len(PNG)
    assert got.headers["content-range"] == f"bytes {first}-{first + len(expected) - 1}/{len(PNG)}"
    assert got.headers["content-length"] == str(len(expected))
    # an If-Range that names another version: the whole output, not a piece of the wrong one
    stale = {**api.auth("alice"), "Range": header, "If-Range": '"0000"'}
    whole = httpx.get(output_url(api, job_id, 0), headers=stale)
    assert (whole.status_code, whole.content) == (200, PNG)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (f"bytes={len(PNG)}-", f"the output has {len(PNG)} bytes; the range starts at byte"),
        ("bytes=0-1,4-5", "one range per request"),
        ("bytes=9-3", "ends before it starts"),
        ("bytes=-0", "is empty"),
        ("bytes=abc", "a range is bytes=START-END"),
        ("bytes=-", "a range is bytes=START-END"),
        ("items=0-1", "only byte ranges"),
        ("bytes=" + "9" * 5000 + "-", "too long"),
    ],
)
def test_a_range_it_cannot_serve_is_a_416_naming_why(api: Api, header: str, reason: str) -> None:
    job_id = local_job(api, [(PNG, "image/png", "png")])
    got = httpx.get(output_url(api, job_id, 0), headers={**api.auth("alice"), "Range": header})
    if len(header) > 256:  # longer than the route reads: the header itself is refused
        assert got.status_code == 422, got.text
        return
    assert got.status_code == 416, got.text
    assert reason in got.json()["detail"]
    assert got.headers["content-range"] == f"bytes */{len(PNG)}"


def s3_storage(s3_settings: StorageSettings) -> dict[str, Any]:
    """The API's storage settings of the moto server's bucket (what `make_api` takes)."""
    names = (
        "storage_url",
        "s3_endpoint_url",
        "s3_region",
        "s3_addressing_style",
        "s3_access_key_id",
        "s3_secret_access_key",
    )
    return {name: getattr(s3_settings, name) for name in names}


def test_outputs_in_s3_are_streamed_with_ranges_as_a_video_player_asks(
    make_api: ApiFactory, s3_settings: StorageSettings
) -> None:
    api = make_api(storage=s3_storage(s3_settings))
    job_id = local_job(api, [(MP4, "video/mp4", "mp4")])
    url = output_url(api, job_id, 0)
    whole = httpx.get(url, headers=api.auth("alice"))
    assert (whole.status_code, whole.headers["content-type"]) == (200, "video/mp4")
    assert whole.content == MP4
    # what Chromium's media player sends first, then a seek near the end
    first = httpx.get(url, headers={**api.auth("alice"), "Range": "bytes=0-"})
    assert first.status_code == 206
    assert first.headers["content-range"] == f"bytes 0-{len(MP4) - 1}/{len(MP4)}"
    seek = httpx.get(url, headers={**api.auth("alice"), "Range": "bytes=250000-250099"})
    assert (seek.status_code, seek.content) == (206, MP4[250000:250100])
    past = httpx.get(url, headers={**api.auth("alice"), "Range": f"bytes={len(MP4)}-"})
    assert past.status_code == 416


def test_an_output_is_read_from_the_store_its_record_names(
    make_api: ApiFactory, s3_settings: StorageSettings, tmp_path: Path
) -> None:
    api = make_api(storage=s3_storage(s3_settings))  # the API's own store is S3
    folder = tmp_path / "a-node-with-a-local-store"
    local = LocalObjectStore(folder)
    owner = api.key_ids["alice"]
    job_id = finished_job(
        api.store, local, f"file://{folder}", [(PNG, "image/webp", "webp")], owner
    )
    got = httpx.get(output_url(api, job_id, 0), headers=api.auth("alice"))
    assert (got.status_code, got.content) == (200, PNG)
    assert got.headers["content-type"] == "image/webp"
