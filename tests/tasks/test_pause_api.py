"""`POST /v1/jobs/{id}/pause` and `/resume` through a real API server and Redis."""

from __future__ import annotations

from typing import Any

import httpx

from kiln.common.stops import StopReason
from kiln.storage.leases import StopRequest
from kiln.storage.preemption import PreemptionOps
from tests.tasks.helpers import Api, drive_to_success

SMALL = {"prompt": "a kiln at dusk", "width": 64, "height": 64, "steps": 2}


def _post(api: Api, job_id: str, action: str, who: str = "alice") -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs/{job_id}/{action}", headers=api.auth(who))


def _new_job(api: Api) -> str:
    response = httpx.post(f"{api.url}/v1/jobs", json=SMALL, headers=api.auth())
    job_id: str = response.json()["id"]
    return job_id


def _event_types(api: Api, job_id: str) -> list[str]:
    return [e.type for e in api.store.events(job_id, count=100)]


def test_a_queued_job_pauses_and_resumes(api: Api) -> None:
    job_id = _new_job(api)
    paused = _post(api, job_id, "pause")
    assert paused.status_code == 200
    body: dict[str, Any] = paused.json()
    assert body["effect"] == "paused"
    assert body["job"]["status"] == "paused"
    listed = httpx.get(f"{api.url}/v1/jobs?status=paused", headers=api.auth()).json()
    assert [job["id"] for job in listed["jobs"]] == [job_id]
    assert _post(api, job_id, "pause").json()["effect"] == "already_paused"

    resumed = _post(api, job_id, "resume").json()
    assert resumed["effect"] == "resumed"
    assert resumed["job"]["status"] == "queued"
    assert api.store.get(job_id).published  # its message went out again
    assert _event_types(api, job_id) == ["queued", "paused", "resumed"]
    assert _post(api, job_id, "resume").json()["effect"] == "not_paused"


def test_a_running_job_is_asked_to_pause_and_resume_withdraws_it(api: Api) -> None:
    job_id = _new_job(api)
    api.store.start(job_id, api.store.acquire_lease(job_id, "node"))
    asked = _post(api, job_id, "pause").json()
    assert asked["effect"] == "pause_requested"
    assert asked["job"]["status"] == "running"
    assert api.store.stops_requested([job_id]) == {job_id: StopRequest(StopReason.PAUSED)}
    assert _post(api, job_id, "resume").json()["effect"] == "pause_withdrawn"
    assert api.store.stops_requested([job_id]) == {}
    httpx.post(f"{api.url}/v1/jobs/{job_id}/cancel", headers=api.auth())
    refused = _post(api, job_id, "pause")  # a pending cancel is not turned into a pause
    assert refused.status_code == 409
    assert "cancel is pending" in refused.json()["detail"]


def test_a_pause_of_a_job_a_preemption_stops_is_asked_and_a_resume_withdraws_nothing(
    api: Api,
) -> None:
    job_id = _new_job(api)
    api.store.start(job_id, api.store.acquire_lease(job_id, "node"))
    ops = PreemptionOps(api.store.redis, api.store.settings)
    assert ops.request_preemption(job_id, "waiting-1", cap=2, min_run_s=0.0, ttl_s=30.0)
    assert _post(api, job_id, "resume").json()["effect"] == "not_paused"  # no pause pending
    asked = _post(api, job_id, "pause").json()
    assert asked["effect"] == "pause_requested"  # the pause replaces the preemption
    assert api.store.stops_requested([job_id]) == {job_id: StopRequest(StopReason.PAUSED)}


def test_finished_unknown_and_others_jobs_are_refused(api: Api) -> None:
    job_id = _new_job(api)
    drive_to_success(api.store, job_id, steps=1)
    for action in ("pause", "resume"):
        refused = _post(api, job_id, action)
        assert refused.status_code == 409
        assert "is succeeded" in refused.json()["detail"]
    assert _post(api, "job-nosuchjob", "pause").status_code == 404
    other = _new_job(api)
    assert _post(api, other, "pause", who="bob").status_code == 403
    assert _post(api, other, "pause", who="admin").json()["effect"] == "paused"
    assert _post(api, other, "resume", who="bob").status_code == 403
