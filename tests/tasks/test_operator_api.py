"""Operator routes, queue positions and per-key quotas over real HTTP, on the real job store."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest

from kiln.common.states import JobState
from kiln.storage.apikeys import ApiKeyStore
from kiln.tasks.api.auth import hash_api_key, new_api_key
from kiln.tasks.cli.keys import run
from kiln.tasks.client.client import KilnClient, QueueFull
from kiln.tasks.queue.positions import jobs_ahead
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, start_job

SMALL = {"prompt": "a kiln", "width": 64, "height": 64, "steps": 2, "pipeline": "tiny"}


def post_job(api: Api, who: str = "alice", **fields: Any) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={**SMALL, **fields}, headers=api.auth(who))


def get_view(api: Api, job_id: str, who: str = "alice") -> dict[str, Any]:
    response = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth(who))
    assert response.status_code == 200, response.text
    view: dict[str, Any] = response.json()
    return view


def admin(api: Api, method: str, path: str, who: str = "admin", **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{api.url}/v1/admin{path}", headers=api.auth(who), **kw)


def add_capped_key(api: Api, name: str, max_queued: int) -> None:
    secret = new_api_key()
    pepper = api.settings.api_key_pepper.get_secret_value()
    key = ApiKeyStore(api.store.redis, api.storage_settings).create(
        hash_api_key(secret, pepper), name, max_queued=max_queued
    )
    api.keys[name], api.key_ids[name] = secret, key.id


# --- operator controls ----------------------------------------------------------------------------


def test_admin_routes_need_an_admin_key(api: Api) -> None:
    for method, path in (
        ("GET", "/queues"),
        ("POST", "/queues/bulk.tiny/pause"),
        ("POST", "/queues/bulk.tiny/resume"),
        ("POST", "/queues/bulk.tiny/purge"),
        ("POST", "/nodes/node-1/drain"),
        ("DELETE", "/nodes/node-1/drain"),
    ):
        assert admin(api, method, path, who="alice").status_code == 403, path
        assert httpx.request(method, f"{api.url}/v1/admin{path}").status_code == 401, path
    assert api.store.paused_queues() == {}
    assert api.store.drain_requests() == {}


@pytest.mark.parametrize("queue", ["tiny", "urgent.tiny", "bulk.", "bulk.-x"])
def test_a_bad_queue_name_is_a_422(api: Api, queue: str) -> None:
    response = admin(api, "POST", f"/queues/{queue}/pause")
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["path", "queue"]


def test_pause_and_resume_are_listed(api: Api) -> None:
    job_id = post_job(api, priority="bulk").json()["id"]
    paused = admin(api, "POST", "/queues/bulk.tiny/pause").json()
    assert paused == {"queue": "bulk.tiny", "paused": True, "changed": True}
    assert admin(api, "POST", "/queues/bulk.tiny/pause").json()["changed"] is False
    queues = {q["queue"]: q for q in admin(api, "GET", "/queues").json()["queues"]}
    assert queues["bulk.tiny"]["paused"] is True
    assert queues["bulk.tiny"]["paused_by"] == "admin"
    assert queues["bulk.tiny"]["queued"] == 1
    assert queues["interactive.tiny"] == {
        "queue": "interactive.tiny",
        "queued": 0,
        "paused": False,
        "paused_at": None,
        "paused_by": "",
    }
    nodes = httpx.get(f"{api.url}/v1/nodes", headers=api.auth()).json()
    assert nodes["paused_queues"] == ["bulk.tiny"]
    view = get_view(api, job_id)  # paused: a position, no estimate
    assert (view["queue_position"], view["estimated_start_s"]) == (0, None)
    resumed = admin(api, "POST", "/queues/bulk.tiny/resume").json()
    assert resumed == {"queue": "bulk.tiny", "paused": False, "changed": True}
    assert api.store.paused_queues() == {}


def test_purge_cancels_queued_jobs_with_events_and_leaves_running_ones(api: Api) -> None:
    ids = [post_job(api, priority="bulk").json()["id"] for _ in range(3)]
    other = post_job(api).json()["id"]  # interactive.tiny: another queue
    start_job(api.store, ids[0])  # running: not purged
    result = admin(api, "POST", "/queues/bulk.tiny/purge").json()
    assert result == {"queue": "bulk.tiny", "canceled": 2, "job_ids": ids[1:]}
    for job_id in ids[1:]:
        view = get_view(api, job_id)
        assert view["status"] == "canceled"
        events = api.store.events(job_id)
        assert [e.type for e in events] == ["queued", "canceled"]
        assert events[-1].payload == {"reason": "purged"}
    assert api.store.get(ids[0]).state == JobState.RUNNING
    assert not api.store.cancel_requested(ids[0])
    assert api.store.get(other).state == JobState.QUEUED
    assert admin(api, "POST", "/queues/bulk.tiny/purge").json()["canceled"] == 0


def test_drain_requests_through_the_api_and_the_client(api: Api) -> None:
    with KilnClient(api.url, api_key=api.keys["admin"]) as client:
        drained = client.drain_node("node-7", exit=True)
        assert (drained.node_id, drained.drain_requested, drained.exit) == ("node-7", True, True)
        assert api.store.drain_requests()["node-7"].exit is True
        assert api.store.drain_requests()["node-7"].by == "admin"
        nodes = httpx.get(f"{api.url}/v1/nodes", headers=api.auth()).json()
        assert nodes["drain_requests"] == ["node-7"]
        assert client.undrain_node("node-7").drain_requested is False
        assert api.store.drain_requests() == {}
        assert client.pause_queue("interactive.tiny").changed is True
        assert [q.queue for q in client.queues().queues if q.paused] == ["interactive.tiny"]
        assert client.resume_queue("interactive.tiny").paused is False


# --- queue positions and estimates -----------------------------------------------------------


def test_positions_count_the_jobs_ahead_and_the_lane_policy(api: Api) -> None:
    bulk = [post_job(api, priority="bulk").json() for _ in range(2)]
    first = post_job(api).json()
    assert first["queue_position"] == 0  # the submit response carries it too
    views = [get_view(api, job["id"]) for job in (first, *bulk)]
    # the interactive job goes first; each bulk job waits for it (one interactive job queued)
    assert [v["queue_position"] for v in views] == [0, 1, 2]
    assert all(v["estimated_start_s"] is None for v in views)  # nothing has finished yet
    start_job(api.store, first["id"])
    assert [get_view(api, b["id"])["queue_position"] for b in bulk] == [0, 1]
    assert get_view(api, first["id"])["queue_position"] is None  # running: no position


def test_an_estimate_appears_once_runs_have_finished(api: Api) -> None:
    done = post_job(api).json()["id"]
    waiting = [post_job(api).json()["id"] for _ in range(2)]
    drive_to_success(api.store, done)  # a run of tiny finished: a completion rate exists
    estimates = [get_view(api, job_id)["estimated_start_s"] for job_id in waiting]
    assert all(isinstance(e, float) and e > 0 for e in estimates), estimates
    assert estimates[0] < estimates[1]
    listed = httpx.get(f"{api.url}/v1/jobs", headers=api.auth()).json()["jobs"]
    assert all(job["queue_position"] is None for job in listed)  # not computed for lists


def test_jobs_ahead_follows_the_bulk_share() -> None:
    # bulk at rank b: b bulk ahead, and up to `every` interactive before each bulk and itself
    assert jobs_ahead("bulk", 0, 10, 4) == 4
    assert jobs_ahead("bulk", 1, 10, 4) == 1 + 8
    assert jobs_ahead("bulk", 1, 3, 4) == 1 + 3
    assert jobs_ahead("bulk", 2, 10, 0) == 2  # bulk_share_every 0: bulk first
    # interactive at rank r: r interactive ahead, and a bulk one after each `every` of them
    assert jobs_ahead("interactive", 3, 10, 4) == 3
    assert jobs_ahead("interactive", 9, 10, 4) == 9 + 2
    assert jobs_ahead("interactive", 9, 1, 4) == 9 + 1
    assert jobs_ahead("interactive", 2, 5, 0) == 2 + 5


# --- per-key quotas ---------------------------------------------------------------------------


@pytest.mark.every_redis  # an error path: the embedded 6.2 too
def test_past_max_queued_a_submit_is_a_429_until_one_leaves(make_api: ApiFactory) -> None:
    api = make_api(max_queued_per_key=2, queue_full_retry_after_s=7)
    first, second = (post_job(api).json()["id"] for _ in range(2))
    refused = post_job(api)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "7"
    assert "2 queued jobs" in refused.json()["detail"]
    assert post_job(api, who="bob").status_code == 201  # a cap per key
    # an idempotent replay of an accepted job still answers with the job
    headers = {**api.auth("bob"), "Idempotency-Key": "once"}
    body = {**SMALL, "seed": 1}
    assert httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers).status_code == 201
    assert httpx.post(f"{api.url}/v1/jobs", json=body, headers=headers).status_code == 200
    httpx.post(f"{api.url}/v1/jobs/{first}/cancel", headers=api.auth())
    assert post_job(api).status_code == 201  # room again
    assert post_job(api).status_code == 429
    drive_to_success(api.store, second)  # leaving queued for running frees a place at once...
    assert post_job(api).status_code == 201
    with KilnClient(api.url, api_key=api.keys["alice"]) as client, pytest.raises(QueueFull):
        client.submit(SMALL)


def test_a_keys_own_cap_overrides_the_default(make_api: ApiFactory) -> None:
    api = make_api(max_queued_per_key=5)
    add_capped_key(api, "tight", max_queued=1)
    assert post_job(api, who="tight").status_code == 201
    assert post_job(api, who="tight").status_code == 429
    for _ in range(5):
        assert post_job(api, who="alice").status_code == 201
    assert post_job(api, who="alice").status_code == 429


def test_no_cap_by_default(api: Api) -> None:
    assert all(post_job(api).status_code == 201 for _ in range(5))


def test_keys_create_stores_the_caps_the_api_applies(make_api: ApiFactory) -> None:
    api = make_api()
    out = io.StringIO()
    code = run(
        "create", "batch-bot", as_json=True, settings=api.settings,
        storage_settings=api.storage_settings, out=out, max_queued=1, max_running=2,
    )  # fmt: skip
    created = json.loads(out.getvalue())
    assert code == 0
    assert (created["max_queued"], created["max_running"]) == (1, 2)
    headers = {"Authorization": f"Bearer {created['key']}"}
    url = f"{api.url}/v1/jobs"
    assert httpx.post(url, json=SMALL, headers=headers).status_code == 201
    assert httpx.post(url, json=SMALL, headers=headers).status_code == 429
    refused = run("create", "x", settings=api.settings, storage_settings=api.storage_settings,
                  out=io.StringIO(), max_queued=0)  # fmt: skip
    assert refused == 2
