"""The dead-letter routes against a real API (uvicorn, Redis): listing, showing, redriving."""

from __future__ import annotations

import httpx
import pytest

from kiln.tasks.contract.dead_letters import MAX_REDRIVE
from kiln.tasks.intake.redrive import REDRIVE_OF
from tests.tasks.helpers import Api

BROKE = {
    "type": "WorkerGroupDied",
    "message": "the worker group died",
    "retryable": False,
    "poison": "group_broken_twice",
}


def dead_jobs(api: Api, n: int, key: str = "alice") -> list[str]:
    """Submit `n` jobs through the API as `key` and fail each (queued → failed, as a node does)."""
    ids = []
    with httpx.Client(base_url=api.url, headers=api.auth(key)) as client:
        for i in range(n):
            got = client.post("/v1/jobs", json={"prompt": f"p{i}", "pipeline": "tiny"})
            assert got.status_code == 201, got.text
            ids.append(got.json()["id"])
    for job_id in ids:
        api.store.fail(job_id, None, BROKE)
    return ids


def test_the_list_is_owner_scoped_and_paged_as_jobs_are(api: Api) -> None:
    mine = dead_jobs(api, 3)
    theirs = dead_jobs(api, 1, key="bob")
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        got = httpx.get(f"{api.url}/v1/dead-letters", params=params, headers=api.auth())
        assert got.status_code == 200, got.text
        seen += [d["id"] for d in got.json()["dead_letters"]]
        cursor = got.json()["next_cursor"]
        if cursor is None:
            break
    assert seen == mine[::-1]
    every = httpx.get(f"{api.url}/v1/dead-letters", headers=api.auth("admin")).json()
    assert [d["id"] for d in every["dead_letters"]] == [*theirs, *mine[::-1]]
    refused = httpx.get(f"{api.url}/v1/dead-letters", params={"owner": "x"}, headers=api.auth())
    assert refused.status_code == 403


def test_a_dead_letter_shows_its_request_error_and_owner_only_to_its_owner(api: Api) -> None:
    [job_id] = dead_jobs(api, 1)
    got = httpx.get(f"{api.url}/v1/dead-letters/{job_id}", headers=api.auth())
    assert got.status_code == 200
    view = got.json()
    assert view["request"]["prompt"] == "p0"
    assert view["error"] == BROKE
    assert view["poison"] == "group_broken_twice"
    assert view["owner"] == api.key_ids["alice"]
    assert view["checkpoint"] is None
    other = httpx.get(f"{api.url}/v1/dead-letters/{job_id}", headers=api.auth("bob"))
    assert other.status_code == 403
    missing = httpx.get(f"{api.url}/v1/dead-letters/nothing-here", headers=api.auth())
    assert missing.status_code == 404


def test_a_dry_run_lists_and_changes_nothing(api: Api) -> None:
    ids = dead_jobs(api, 3)
    namespace = f"{api.storage_settings.redis_namespace}:*"
    keys_before = sorted(api.store.redis.keys(namespace))
    body = {"filter": {"poison": True, "error_type": "WorkerGroupDied"}, "dry_run": True}
    got = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth())
    assert got.status_code == 200, got.text
    result = got.json()
    assert result["redriven"] == 0
    assert [(r["id"], r["outcome"]) for r in result["results"]] == [
        (job_id, "would_redrive") for job_id in ids[::-1]
    ]
    assert sorted(api.store.redis.keys(namespace)) == keys_before
    for job_id in ids:
        letter = httpx.get(f"{api.url}/v1/dead-letters/{job_id}", headers=api.auth()).json()
        assert letter["redriven_to"] is None


def test_a_redrive_makes_one_new_job_naming_the_old_and_never_two(api: Api) -> None:
    [job_id] = dead_jobs(api, 1)
    body = {"ids": [job_id, "unknown-id"], "rate": 100}
    got = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth())
    assert got.status_code == 200, got.text
    first, unknown = got.json()["results"]
    assert first["outcome"] == "redriven"
    assert unknown["outcome"] == "not_found"
    new = httpx.get(f"{api.url}/v1/jobs/{first['new_job_id']}", headers=api.auth()).json()
    assert new["status"] == "queued"
    assert new["metadata"][REDRIVE_OF] == job_id
    assert api.store.get(new["id"]).request["prompt"] == "p0"
    again = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth())
    assert again.json()["results"][0]["outcome"] == "already_redriven"
    assert again.json()["redriven"] == 0
    theirs = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth("bob"))
    assert theirs.json()["results"][0]["outcome"] == "forbidden"


@pytest.mark.slow  # 100 jobs paced at 50 per second: about 2 s
def test_a_redrive_of_100_dead_jobs_respects_the_rate(api: Api) -> None:
    rate = 50
    ids = dead_jobs(api, 100)
    body = {"ids": ids, "rate": rate}
    got = httpx.post(
        f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth(), timeout=60
    )
    assert got.status_code == 200, got.text
    assert got.json()["redriven"] == 100
    new_ids = [r["new_job_id"] for r in got.json()["results"]]
    created = sorted(r.created_at for r in api.store.get_many(new_ids) if r is not None)
    assert len(created) == 100
    # paced: 99 gaps of 1/rate s at least (less the jitter of the first write), and no second
    # holds many more than `rate` of them (all 100 would fall in one without pacing)
    assert created[-1] - created[0] >= 99 / rate - 0.5
    busiest = max(sum(1 for t in created if start <= t < start + 1) for start in created)
    assert busiest <= rate * 1.5


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"ids": ["a"], "filter": {}},
        {"ids": []},
        {"ids": ["a"] * (MAX_REDRIVE + 1)},
        {"ids": ["a"], "rate": 0},
        {"ids": ["a"], "rate": -1},
        {"ids": ["a"], "rate": 1e9},
        {"ids": ["a"], "rate": "fast"},
        {"ids": "a"},
        {"ids": [1, 2]},
        {"ids": ["../x"], "dry_run": "maybe"},
        {"filter": {"since": -1}},
        {"filter": {"since": "5"}},  # a string is not a time, though it reads as one
        {"filter": {"poison": 0.0}},  # a number is not a yes or no (the schema fuzz's find)
        {"ids": ["a"], "dry_run": 1},
        {"filter": {"unknown": 1}},
        {"filter": {"error_type": "x" * 1000}},
        {"filter": []},
        {"ids": ["a"], "limit": 0},
        {"nonsense": True},
        [],
        "redrive",
    ],
)
def test_hostile_redrive_bodies_are_422_never_500(api: Api, body: object) -> None:
    got = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth())
    assert got.status_code == 422, got.text
    assert got.json()["detail"]


def test_a_redrive_that_would_outlast_a_call_is_refused_naming_rate(api: Api) -> None:
    body = {"ids": [f"j{i}" for i in range(MAX_REDRIVE)], "rate": 1}
    got = httpx.post(f"{api.url}/v1/dead-letters/redrive", json=body, headers=api.auth())
    assert got.status_code == 422
    assert got.json()["detail"][0]["loc"] == ["body", "rate"]


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/v1/dead-letters", {"cursor": "abc"}),
        ("/v1/dead-letters", {"cursor": "-1"}),
        ("/v1/dead-letters", {"limit": "0"}),
        ("/v1/dead-letters", {"limit": "x"}),
        ("/v1/dead-letters", {"limit": "1000000"}),
        ("/v1/dead-letters", {"nope": "1"}),
        ("/v1/dead-letters", {"cursor": "9" * 300}),
        ("/v1/dead-letters/" + "x" * 200, {}),
        ("/v1/dead-letters/..%2f", {}),
        ("/v1/dead-letters/%00", {}),
    ],
)
def test_hostile_reads_are_4xx_never_500(api: Api, path: str, params: dict[str, str]) -> None:
    got = httpx.get(api.url + path, params=params, headers=api.auth())
    assert 400 <= got.status_code < 500, got.text


def test_the_routes_need_a_key(api: Api) -> None:
    assert httpx.get(f"{api.url}/v1/dead-letters").status_code == 401
    assert httpx.post(f"{api.url}/v1/dead-letters/redrive", json={"ids": ["a"]}).status_code == 401


def test_metrics_count_the_dead_letters(api: Api) -> None:
    dead_jobs(api, 2)
    text = httpx.get(f"{api.url}/metrics").text
    assert "kiln_dead_letters 2.0" in text.splitlines()
