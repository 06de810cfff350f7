"""The HTTP API over real HTTP (uvicorn on 127.0.0.1) with the real job store in Redis."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from kiln.storage.settings import StorageSettings
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, fake_dns, queued_job

SMALL = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 2}


def post_job(
    api: Api, body: dict[str, Any] | None = None, who: str = "alice", key: str | None = None
) -> httpx.Response:
    headers = {**api.auth(who), **({"Idempotency-Key": key} if key else {})}
    return httpx.post(f"{api.url}/v1/jobs", json=body or SMALL, headers=headers)


def sse_events(text: str) -> list[dict[str, Any]]:
    """The `data` of each event in an SSE body, checking `id` matches the seq."""
    events = []
    for frame in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if "data" in fields:
            data = json.loads(fields["data"])
            assert int(fields["id"]) == data["seq"]
            assert fields["event"] == data["type"]
            events.append(data)
    return events


def test_submit_get_and_the_whole_view(api: Api) -> None:
    created = post_job(api, {**SMALL, "metadata": {"ticket": "42"}})
    assert created.status_code == 201
    view = created.json()
    assert view["status"] == "queued"
    assert view["attempts"] == 0
    assert view["parameters"]["seed"] is not None  # drawn at submit and recorded
    assert view["metadata"] == {"ticket": "42"}
    drive_to_success(api.store, view["id"])
    got = httpx.get(f"{api.url}/v1/jobs/{view['id']}", headers=api.auth()).json()
    assert got["status"] == "succeeded"
    assert got["attempts"] == 1
    assert got["progress"] is None  # a finished job is past every stage (issue 18)
    assert got["outputs"][0]["url"]
    assert got["outputs"][0]["bytes"] == 3
    assert got["metrics"]["run_s"] == 0.2
    assert got["parameters"]["seed"] == view["parameters"]["seed"]
    missing = httpx.get(f"{api.url}/v1/jobs/nope", headers=api.auth())
    assert missing.status_code == 404
    assert httpx.get(f"{api.url}/v1/jobs/..%2F..", headers=api.auth()).status_code == 404


@pytest.mark.every_redis  # an error path: the embedded 6.2 too
def test_idempotency_key(api: Api) -> None:
    first = post_job(api, key="k-1")
    again = post_job(api, key="k-1")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    other_body = {**SMALL, "prompt": "something else"}
    conflict = post_job(api, other_body, key="k-1")
    assert conflict.status_code == 409
    assert "Idempotency-Key" in conflict.json()["detail"]
    # Keys are per API key: bob's k-1 is a job of his own.
    bob = post_job(api, who="bob", key="k-1")
    assert bob.status_code == 201
    assert bob.json()["id"] != first.json()["id"]


@pytest.mark.parametrize(
    ("patch", "loc"),
    [
        ({"width": 65}, ["body", "width"]),
        ({"steps": 501}, ["body", "steps"]),
        ({"num_frames": 4, "output_format": "png"}, ["body", "output_format"]),
        ({"guidance_scale": 51}, ["body", "guidance_scale"]),
        ({"prompt": ""}, ["body", "prompt"]),
        ({"colour": "red"}, ["body", "colour"]),
        (
            {"webhook": {"url": "https://example.com", "events": ["done"]}},
            ["body", "webhook", "events", 0],
        ),
    ],
)
def test_invalid_fields_are_422_naming_the_field(
    api: Api, patch: dict[str, Any], loc: list[Any]
) -> None:
    response = post_job(api, {**SMALL, **patch})
    assert response.status_code == 422
    assert loc in [error["loc"] for error in response.json()["detail"]]


def test_unknown_pipeline_lists_the_served_ones(api: Api) -> None:
    api.store.publish_node("node-a", {"pipelines": ["sdxl"]}, ttl_s=30)
    response = post_job(api, {**SMALL, "pipeline": "flux"})
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert error["loc"] == ["body", "pipeline"]
    assert error["ctx"]["known"] == ["default", "sdxl", "tiny", "tiny-video"]
    assert post_job(api, {**SMALL, "pipeline": "sdxl"}).status_code == 201


def test_body_over_the_limit_is_413(make_api: ApiFactory) -> None:
    api = make_api(max_body_bytes=2048)
    big = {**SMALL, "prompt": "x" * 3000}
    assert post_job(api, big).status_code == 413

    def chunks() -> Any:  # no Content-Length: the limit is counted while streaming
        payload = json.dumps(big).encode()
        for i in range(0, len(payload), 500):
            yield payload[i : i + 500]

    streamed = httpx.post(
        f"{api.url}/v1/jobs",
        content=chunks(),
        headers={**api.auth(), "content-type": "application/json"},
    )
    assert streamed.status_code == 413
    assert post_job(api).status_code == 201


@pytest.mark.every_redis  # an error path: the embedded 6.2 too
def test_queue_depth_limit_is_429_with_retry_after(make_api: ApiFactory) -> None:
    api = make_api(max_queue_depth=2, queue_full_retry_after_s=7)
    assert [post_job(api).status_code for _ in range(2)] == [201, 201]
    full = post_job(api)
    assert full.status_code == 429
    assert full.headers["Retry-After"] == "7"


def test_auth_401_403_admin_and_revocation(api: Api) -> None:
    assert httpx.post(f"{api.url}/v1/jobs", json=SMALL).status_code == 401
    wrong = {"Authorization": "Bearer kiln_not-a-key"}
    assert httpx.get(f"{api.url}/v1/jobs", headers=wrong).status_code == 401
    basic = {"Authorization": "Basic Zm9vOmJhcg=="}
    assert httpx.get(f"{api.url}/v1/jobs", headers=basic).status_code == 401
    job_id = post_job(api).json()["id"]
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth("bob")).status_code == 403
    bob_cancel = httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=api.auth("bob"))
    assert bob_cancel.status_code == 403
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth("admin")).status_code == 200
    from kiln.storage.apikeys import ApiKeyStore

    ApiKeyStore(api.store.redis, api.storage_settings).revoke(api.key_ids["alice"])
    assert_refused_after_cache(api, f"/v1/jobs/{job_id}", api.auth())


def assert_refused_after_cache(api: Api, path: str, headers: dict[str, str]) -> None:
    """A revoked key: 401 at the latest KILN_API_KEY_CACHE_S later (live keys are cached)."""
    revoked_at = time.monotonic()
    while httpx.get(f"{api.url}{path}", headers=headers).status_code != 401:
        assert time.monotonic() - revoked_at < api.settings.api_key_cache_s + 5  # shared CPU
        time.sleep(0.05)


def test_auth_switched_off(make_api: ApiFactory) -> None:
    api = make_api(auth_enabled=False)
    job_id = httpx.post(f"{api.url}/v1/jobs", json=SMALL).json()["id"]
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}").json()["status"] == "queued"


def test_cancel_says_whether_it_took_effect(api: Api) -> None:
    queued = post_job(api).json()["id"]
    result = httpx.post(f"{api.url}/v1/jobs/{queued}/cancel", headers=api.auth()).json()
    assert result["effect"] == "canceled"
    assert result["job"]["status"] == "canceled"
    running = post_job(api).json()["id"]
    token = api.store.acquire_lease(running, "node")
    api.store.start(running, token)
    result = httpx.post(f"{api.url}/v1/jobs/{running}/cancel", headers=api.auth()).json()
    assert result["effect"] == "cancel_requested"
    assert result["job"]["status"] == "running"
    assert api.store.cancel_requested(running)
    again = httpx.post(f"{api.url}/v1/jobs/{queued}/cancel", headers=api.auth()).json()
    assert again["effect"] == "already_finished"


def test_events_stream_ends_after_terminal_and_resumes(api: Api) -> None:
    job_id = post_job(api).json()["id"]
    collected: list[dict[str, Any]] = []

    def listen() -> None:  # connected before anything happens: live events arrive in order
        with httpx.stream(
            "GET", f"{api.url}/v1/jobs/{job_id}/events", headers=api.auth(), timeout=60
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            collected.extend(sse_events(response.read().decode()))

    listener = threading.Thread(target=listen)
    listener.start()
    drive_to_success(api.store, job_id, steps=3)
    listener.join(timeout=60)
    assert not listener.is_alive(), "the stream must end after the terminal event"
    assert [e["type"] for e in collected] == [
        "queued",
        "running",
        "progress",
        "progress",
        "progress",
        "succeeded",
    ]
    assert [e["seq"] for e in collected] == [1, 2, 3, 4, 5, 6]
    resumed = httpx.get(
        f"{api.url}/v1/jobs/{job_id}/events",
        headers={**api.auth(), "Last-Event-ID": "3"},
        timeout=60,
    )
    assert [e["seq"] for e in sse_events(resumed.text)] == [4, 5, 6]
    by_query = httpx.get(f"{api.url}/v1/jobs/{job_id}/events?after=5", headers=api.auth())
    assert [e["type"] for e in sse_events(by_query.text)] == ["succeeded"]
    past_end = httpx.get(f"{api.url}/v1/jobs/{job_id}/events?after=6", headers=api.auth())
    assert past_end.status_code == 200
    assert sse_events(past_end.text) == []


def test_list_filters_and_cursor_paging(api: Api) -> None:
    mine = [post_job(api).json()["id"] for _ in range(5)]
    post_job(api, who="bob")
    drive_to_success(api.store, mine[0])
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{api.url}/v1/jobs", params=params, headers=api.auth()).json()
        assert len(page["jobs"]) <= 2
        seen += [job["id"] for job in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(mine))  # newest first, alice's only, no repeats
    done = httpx.get(f"{api.url}/v1/jobs?status=succeeded", headers=api.auth()).json()
    assert [job["id"] for job in done["jobs"]] == [mine[0]]
    everyone = httpx.get(f"{api.url}/v1/jobs?limit=100", headers=api.auth("admin")).json()
    assert len(everyone["jobs"]) == 6
    bobs = httpx.get(
        f"{api.url}/v1/jobs", params={"owner": api.key_ids["bob"]}, headers=api.auth("admin")
    ).json()
    assert len(bobs["jobs"]) == 1
    snoop = {"owner": api.key_ids["bob"]}
    assert httpx.get(f"{api.url}/v1/jobs", params=snoop, headers=api.auth()).status_code == 403
    bad_cursor = httpx.get(f"{api.url}/v1/jobs?cursor=abc", headers=api.auth())
    assert bad_cursor.status_code == 422
    typo = httpx.get(f"{api.url}/v1/jobs?stauts=failed", headers=api.auth())
    assert typo.status_code == 422
    assert typo.json()["detail"][0]["loc"] == ["query", "stauts"]


def test_outputs_are_presigned_at_read_time(
    s3_settings: StorageSettings, storage_settings: StorageSettings
) -> None:
    # Same Redis namespace, outputs in (moto) S3: each read signs a fresh URL.
    settings = s3_settings.model_copy(
        update={
            "redis_url": storage_settings.redis_url,
            "redis_namespace": storage_settings.redis_namespace,
        }
    )
    from kiln.tasks.api.app import create_app
    from kiln.tasks.api.context import build_context
    from tests.tasks.helpers import ThreadServer, api_settings

    kiln = api_settings(auth_enabled=False)
    ctx = build_context(kiln, settings)
    with ThreadServer(create_app(kiln, settings, context=ctx)) as server:
        job_id = httpx.post(f"{server.url}/v1/jobs", json=SMALL).json()["id"]
        drive_to_success(ctx.store, job_id)
        assert "url" not in ctx.store.get(job_id).outputs[0]  # never stored
        url = httpx.get(f"{server.url}/v1/jobs/{job_id}").json()["outputs"][0]["url"]
    assert "Signature=" in url
    assert "Expires=" in url


def test_webhook_url_checked_at_submit(make_api: ApiFactory) -> None:
    strict = make_api(
        webhook_allow_http=False,
        webhook_allow_hosts=[],
        resolve=fake_dns({"internal.example": ["10.0.0.8"], "ok.example": ["93.184.216.34"]}),
    )
    for url in (
        "https://127.0.0.1/h",
        "https://internal.example/h",
        "http://ok.example/h",
        "https://169.254.169.254/",
        "https://[::ffff:127.0.0.1]/",
        "https://2130706433/",
    ):
        response = post_job(strict, {**SMALL, "webhook": {"url": url}})
        assert response.status_code == 422, url
        assert response.json()["detail"][0]["loc"] == ["body", "webhook", "url"]
    accepted = post_job(strict, {**SMALL, "webhook": {"url": "https://ok.example/h"}})
    assert accepted.status_code == 201
    unsigned = make_api(webhook_secret=None)
    refused = post_job(unsigned, {**SMALL, "webhook": {"url": "http://127.0.0.1:9/h"}})
    assert refused.status_code == 422
    assert "KILN_WEBHOOK_SECRET" in refused.text


def test_health_readiness_nodes_pipelines(api: Api) -> None:
    assert httpx.get(f"{api.url}/healthz").json() == {"status": "ok"}
    not_ready = httpx.get(f"{api.url}/readyz")
    assert not_ready.status_code == 503
    assert not_ready.json()["redis"] is True
    api.store.publish_node("node-1", {"pipelines": ["tiny"], "devices": ["cpu:0"]}, ttl_s=30)
    assert httpx.get(f"{api.url}/readyz").status_code == 200
    assert httpx.get(f"{api.url}/readyz?pipeline=tiny").json()["ready"] is True
    assert httpx.get(f"{api.url}/readyz?pipeline=flux").status_code == 503
    nodes = httpx.get(f"{api.url}/v1/nodes", headers=api.auth()).json()["nodes"]
    assert [n["node_id"] for n in nodes] == ["node-1"]
    pipelines = httpx.get(f"{api.url}/v1/pipelines", headers=api.auth()).json()["pipelines"]
    assert "tiny" in pipelines


def test_webhook_attempts_are_readable(api: Api) -> None:
    job_id = queued_job(api.store, owner=api.key_ids["alice"])
    attempt = {
        "webhook_id": f"msg_{job_id}_completed",
        "event": "completed",
        "attempt": 1,
        "url": "https://example.com/h",
        "time": 1.0,
        "status_code": 500,
        "latency_ms": 3.2,
        "error": "HTTP 500",
        "outcome": "retrying",
        "next_attempt_at": 2.0,
    }
    api.store.record_webhook_attempt(job_id, attempt)
    body = httpx.get(f"{api.url}/v1/jobs/{job_id}/webhooks", headers=api.auth()).json()
    assert body == {"attempts": [attempt]}
    assert (
        httpx.get(f"{api.url}/v1/jobs/{job_id}/webhooks", headers=api.auth("bob")).status_code
        == 403
    )


def test_openapi_documents_every_route(api: Api) -> None:
    doc = httpx.get(f"{api.url}/openapi.json").json()
    assert set(doc["paths"]) >= {
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/webhooks",
        "/v1/nodes",
        "/healthz",
        "/readyz",
    }
    post = doc["paths"]["/v1/jobs"]["post"]
    assert {"200", "201", "401", "409", "413", "422", "429"} <= set(post["responses"])
    assert "Retry-After" in post["responses"]["429"]["headers"]
    request = doc["components"]["schemas"]["JobRequest"]["properties"]
    assert request["width"]["multipleOf"] == 8
    assert request["steps"]["maximum"] == 500


def test_keys_cli_create_list_revoke(api: Api) -> None:
    import io

    from kiln.tasks.cli.keys import run

    def kiln_keys(action: str, arg: str | None = None, admin: bool = False) -> tuple[int, str]:
        out = io.StringIO()
        code = run(
            action,
            arg,
            admin=admin,
            as_json=True,
            settings=api.settings,
            storage_settings=api.storage_settings,
            out=out,
        )
        return code, out.getvalue()

    code, printed = kiln_keys("create", "ci-bot")
    created = json.loads(printed)
    assert code == 0
    assert created["key"].startswith("kiln_")
    assert created["admin"] is False
    headers = {"Authorization": f"Bearer {created['key']}"}
    assert httpx.get(f"{api.url}/v1/jobs", headers=headers).status_code == 200
    listed = json.loads(kiln_keys("list")[1])
    assert created["id"] in [k["id"] for k in listed]
    assert all("key" not in k for k in listed)  # secrets are never shown again
    assert kiln_keys("revoke", created["id"])[0] == 0
    assert kiln_keys("revoke", created["id"])[0] == 1
    assert_refused_after_cache(api, "/v1/jobs", headers)
    assert kiln_keys("create")[0] == 2
