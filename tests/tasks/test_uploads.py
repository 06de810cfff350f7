"""`POST /v1/uploads` and image references at submit, over real HTTP (uvicorn), real Redis.

A local (file://) store, where the API serves the PUT itself, and moto S3 with a presigned PUT.
No node runs: a heartbeat announces the image pipeline's schema, as a node's would.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kiln.storage.keys import Keys
from kiln.storage.settings import StorageSettings
from kiln.storage.uploaded_inputs import new_upload_id, resolve_upload, upload_key
from kiln.tasks.cli.input_files import upload_file
from kiln.tasks.cli.main import main
from kiln.tasks.client.client import KilnClient, ValidationFailed
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.upload_slots import UploadSlotView
from tests.e2e.image_server import CAT
from tests.tasks.helpers import Api, ApiFactory

PIPELINE = "tiny-img2img"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "image": {"type": "string", "minLength": 1, "maxLength": 2048, "x-kiln-image": True},
        "strength": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["image"],
    "additionalProperties": False,
}
ALLOW: dict[str, Any] = {"input_allow_http": True, "input_allow_hosts": ["127.0.0.1"]}


def announce(api: Api) -> None:
    info = {"pipelines": [PIPELINE], "inputs": {PIPELINE: SCHEMA}}
    api.store.publish_node("node-images", info, ttl_s=30)


def job(image: str) -> JobRequest:
    return JobRequest(pipeline=PIPELINE, prompt="a cat", inputs={"image": image})


def refusal(client: KilnClient, image: str) -> dict[str, str]:
    with pytest.raises(ValidationFailed) as refused:
        client.submit(job(image))
    return refused.value.fields


@pytest.fixture
def api(make_api: ApiFactory) -> Api:
    made = make_api(**ALLOW, upload_max_bytes=len(CAT) + 16)
    announce(made)
    return made


def test_an_upload_to_the_local_store_is_the_callers_own(api: Api) -> None:
    with (
        KilnClient(api.url, api.keys["alice"]) as alice,
        KilnClient(api.url, api.keys["bob"]) as bob,
    ):
        slot = alice.upload(CAT)
        assert slot.url == f"{api.url}/v1/uploads/local?upload_id={slot.upload_id}"
        assert slot.key == upload_key("", api.key_ids["alice"], slot.upload_id)
        assert slot.headers == {"Content-Type": "image/png"}
        view = alice.submit(job(slot.ref))
        assert view.parameters.inputs == {"image": slot.ref}
        assert "no such upload for this API key" in refusal(bob, slot.ref)["body.inputs.image"]
        body = {"content_type": "image/png", "bytes": 10}  # a slot asked for, never filled
        empty = httpx.post(f"{api.url}/v1/uploads", json=body, headers=api.auth("alice")).json()
        assert "not uploaded yet" in refusal(alice, empty["ref"])["body.inputs.image"]


def test_upload_requests_over_the_limits_are_refused_naming_the_field(api: Api) -> None:
    url, auth = f"{api.url}/v1/uploads", api.auth("alice")
    cases = [
        ({"content_type": "text/plain", "bytes": 10}, ["body", "content_type"]),
        ({"content_type": "image/png", "bytes": len(CAT) + 17}, ["body", "bytes"]),
        ({"content_type": "image/png", "bytes": 0}, ["body", "bytes"]),
        ({"content_type": "image/png", "bytes": 10, "purpose": "x"}, ["body", "purpose"]),
        ({"content_type": "image/png", "bytes": 10, "extra": 1}, ["body", "extra"]),
    ]
    for body, loc in cases:
        answer = httpx.post(url, json=body, headers=auth)
        assert answer.status_code == 422, body
        assert [error["loc"] for error in answer.json()["detail"]] == [loc]
    assert httpx.post(url, json=cases[0][0]).status_code == 401


def test_the_local_put_takes_only_the_body_its_slot_declared(api: Api) -> None:
    objects = api.ctx.objects
    assert objects is not None
    body = {"content_type": "image/png", "bytes": len(CAT)}
    answer = httpx.post(f"{api.url}/v1/uploads", json=body, headers=api.auth("alice"))
    slot = UploadSlotView.model_validate(answer.json())  # issued, nothing PUT yet
    with KilnClient(api.url, api.keys["alice"]) as alice:
        headers = {**api.auth("alice"), "Content-Type": "image/png"}
        longer = httpx.put(slot.url, content=CAT + b"\0" * 64, headers=headers)
        assert longer.status_code == 413
        assert f"over the {len(CAT)} bytes its upload slot declared" in longer.json()["detail"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused while it streams
            yield CAT
            yield b"\0" * (3 * 1024 * 1024)

        streamed = httpx.put(slot.url, content=chunks(), headers=headers)
        assert streamed.status_code == 413
        assert str(len(CAT)) in streamed.json()["detail"]
        shorter = httpx.put(slot.url, content=CAT[:-1], headers=headers)
        assert shorter.status_code == 422
        assert shorter.json()["detail"][0]["ctx"] == {"declared": len(CAT)}
        assert objects.head(slot.key) is None  # nothing stored, not even in part
        assert list(Path(api.storage_settings.storage_url[7:]).rglob(".tmp-*")) == []
        assert "not uploaded yet" in refusal(alice, slot.ref)["body.inputs.image"]
        headers["Content-Type"] = "application/json"
        wrong = httpx.put(slot.url, content=b"{}", headers=headers)
        assert wrong.status_code == 422
        assert wrong.json()["detail"][0]["loc"] == ["header", "content-type"]
        headers["Content-Type"] = "image/png"
        assert httpx.put(slot.url, content=CAT, headers=headers).status_code == 204
        assert objects.get(slot.key) == CAT


def test_the_local_put_refuses_an_id_never_issued_or_expired(api: Api) -> None:
    headers = {**api.auth("alice"), "Content-Type": "image/png"}
    never = new_upload_id()
    refused = httpx.put(
        f"{api.url}/v1/uploads/local", params={"upload_id": never}, content=CAT, headers=headers
    )
    assert refused.status_code == 404
    assert never in refused.json()["detail"]
    body = {"content_type": "image/png", "bytes": len(CAT)}
    issued = httpx.post(f"{api.url}/v1/uploads", json=body, headers=api.auth("alice")).json()
    bobs = {**api.auth("bob"), "Content-Type": "image/png"}
    assert httpx.put(issued["url"], content=CAT, headers=bobs).status_code == 404  # not his
    slot_key = Keys(api.storage_settings.redis_namespace).upload_slot(
        api.key_ids["alice"], issued["upload_id"]
    )
    assert api.store.redis.pexpire(slot_key, 1)  # the slot's expiry, brought forward
    while api.store.redis.exists(slot_key):
        time.sleep(0.01)
    expired = httpx.put(issued["url"], content=CAT, headers=headers)
    assert expired.status_code == 404
    assert "expired" in expired.json()["detail"]


def test_image_urls_and_malformed_references_are_refused_up_front(api: Api) -> None:
    with KilnClient(api.url, api.keys["alice"]) as alice:
        assert alice.submit(job("http://127.0.0.1:9/cat.png")).status == "queued"  # allow-listed
        private = refusal(alice, "http://10.1.2.3/cat.png")["body.inputs.image"]
        assert private.startswith("refused: '10.1.2.3' resolves to 10.1.2.3, which is")
        assert "32 hex digits" in refusal(alice, "upload:../../etc")["body.inputs.image"]
        assert "nor an https:// URL" in refusal(alice, "file:///etc/passwd")["body.inputs.image"]


def test_a_presigned_put_to_s3(make_api: ApiFactory, s3_settings: StorageSettings) -> None:
    storage = s3_settings.model_dump(include={"storage_url", "s3_endpoint_url", "s3_region"})
    storage |= {
        "s3_addressing_style": "path",
        "s3_access_key_id": s3_settings.s3_access_key_id,
        "s3_secret_access_key": s3_settings.s3_secret_access_key,
    }
    api = make_api(storage=storage, **ALLOW)
    announce(api)
    with KilnClient(api.url, api.keys["alice"]) as alice:
        slot = alice.upload(CAT)
        assert slot.url.startswith(str(s3_settings.s3_endpoint_url))
        assert slot.key.startswith(f"outputs/uploads/{api.key_ids['alice']}/")
        assert alice.submit(job(slot.ref)).parameters.inputs == {"image": slot.ref}
        stored = api.ctx.objects.head(slot.key) if api.ctx.objects else None
        assert stored is not None
        assert (stored.size, stored.content_type) == (len(CAT), "image/png")


def test_cli_uploads_a_file_input_through_the_api_or_straight_to_the_store(
    api: Api,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    picture = tmp_path / "cat.png"
    picture.write_bytes(CAT)
    base = ["submit", "a cat", "--pipeline", PIPELINE, "--input", f"image=@{picture}"]
    # With --api (called as `kiln submit --api` calls it; the backend itself is tested elsewhere)
    remote = argparse.Namespace(api=api.url, api_key=api.keys["alice"])
    objects = api.ctx.objects
    assert objects is not None
    key = resolve_upload(objects, api.key_ids["alice"], upload_file(remote, str(picture)))
    assert objects.get(key) == CAT
    for name, value in {
        "KILN_REDIS_URL": api.storage_settings.redis_url,
        "KILN_REDIS_NAMESPACE": api.storage_settings.redis_namespace,
        "KILN_STORAGE_URL": api.storage_settings.storage_url,
    }.items():
        monkeypatch.setenv(name, value)
    assert main(base) == 0  # no --api: straight to the store, among jobs without an owner
    direct = api.store.get(capsys.readouterr().out.strip())
    key = resolve_upload(objects, direct.owner, direct.request["inputs"]["image"])
    assert key.startswith("uploads/anonymous/")
    assert objects.get(key) == CAT
