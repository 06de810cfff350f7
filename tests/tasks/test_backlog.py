"""The backlog signal (tasks/queue/backlog.py): its arithmetic, its reading, what exports it.

The arithmetic alone on numbers; then through the real store (Redis 6.2 and 7.0 run the scripts),
and through a real API: `/metrics`, `GET /v1/pipelines/{name}` and admission on `POST /v1/jobs`.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from kiln.common.request import Lane
from kiln.storage.job_store import JobStore
from kiln.tasks.contract.settings import KilnSettings
from kiln.tasks.queue.backlog import (
    ADMISSION_READ_S,
    PipelineBacklog,
    lane_targets,
    late_start,
    queue_nodes,
    read_backlog,
)
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, start_job
from tests.tasks.test_observability import scrape

TARGETS: dict[str, float] = {Lane.interactive: 30.0, Lane.bulk: 3600.0}
TINY: dict[str, Any] = {"pipeline": "tiny", "prompt": "a kiln", "width": 64, "height": 64}


# --- the arithmetic -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("jobs", "seconds", "nodes"),
    [
        (0, {}, 0),  # nothing queued: no node for the queue
        (1, {Lane.interactive: 0.5}, 1),  # anything queued: at least one
        (100, {Lane.interactive: 300.0}, 10),  # 300 GPU-s within 30 s
        (1000, {Lane.bulk: 3000.0}, 1),  # bulk may wait: 3000 GPU-s within an hour
        (1000, {Lane.interactive: 60.0, Lane.bulk: 7140.0}, 2),  # the whole queue binds
        (3, {Lane.interactive: 3000.0}, 3),  # never more nodes than queued jobs
    ],
)
def test_queue_nodes_start_every_lane_within_its_target(
    jobs: int, seconds: dict[str, float], nodes: int
) -> None:
    assert queue_nodes(jobs, seconds, TARGETS) == nodes


def backlog(wait: float | None, lane: str = Lane.interactive) -> PipelineBacklog:
    return PipelineBacklog(
        pipeline="tiny",
        now=1000.0,
        queued={lane: 40},
        queued_gpu_s={lane: 40.0},
        job_gpu_s=1.0,
        running_jobs=0,
        busy_nodes=0,
        desired_nodes=2,
        expected_wait_s={Lane.interactive: wait, Lane.bulk: wait},
    )


def test_late_start_refuses_an_interactive_job_its_lane_cannot_start_in_time() -> None:
    settings = KilnSettings()
    refusal = late_start(backlog(20.5), Lane.interactive, 1005.0, settings, now=1000.0)
    assert refusal is not None
    assert refusal.retry_after_s == 16  # ceil(20.5 - 5): the wait left over the budget
    assert "start_by" in refusal.message()
    assert "20.5 s" in refusal.message()
    assert late_start(backlog(4.0), Lane.interactive, 1005.0, settings, now=1000.0) is None


def test_late_start_admits_bulk_unknown_waits_past_deadlines_and_no_deadline() -> None:
    settings = KilnSettings()
    assert late_start(backlog(500.0), Lane.bulk, 1005.0, settings, now=1000.0) is None
    assert late_start(backlog(None), Lane.interactive, 1005.0, settings, now=1000.0) is None
    assert late_start(backlog(500.0), Lane.interactive, 990.0, settings, now=1000.0) is None
    assert late_start(backlog(500.0), Lane.interactive, None, settings, now=1000.0) is None


def test_late_start_holds_a_job_without_start_by_to_its_lane_target_when_asked() -> None:
    settings = KilnSettings(admit_by_target=True, target_start_s_interactive=10)
    refusal = late_start(backlog(25.0), Lane.interactive, None, settings, now=1000.0)
    assert refusal is not None
    assert refusal.retry_after_s == 15
    assert "KILN_TARGET_START_S_INTERACTIVE" in refusal.message()
    assert late_start(backlog(25.0), Lane.bulk, None, settings, now=1000.0) is None


# --- read from the store --------------------------------------------------------------------
def submit(api: Api, **fields: Any) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/jobs", json={**TINY, **fields}, headers=api.auth())


@pytest.mark.every_redis
def test_the_backlog_is_read_from_records(make_api: ApiFactory) -> None:
    api = make_api(target_start_s_interactive=2.0)
    ids = [submit(api).json()["id"] for _ in range(6)]
    submit(api, priority="bulk")
    for job_id in ids[:2]:
        drive_to_success(api.store, job_id)
    start_job(api.store, ids[2])  # running, its lease held by "test-node"
    read = read_backlog(api.store, api.settings, "tiny")
    assert read.queued == {"interactive": 3, "bulk": 1}
    assert (read.running_jobs, read.busy_nodes) == (1, 1)
    assert 0 <= read.job_gpu_s < 5  # the two runs just finished (not the unknown default)
    assert read.queued_gpu_s["interactive"] == pytest.approx(3 * read.job_gpu_s)
    # one busy node, plus queue nodes: at least one while anything is queued
    assert read.desired_nodes == 1 + queue_nodes(4, read.queued_gpu_s, lane_targets(api.settings))
    assert read.expected_wait_s["interactive"] is not None


@pytest.mark.every_redis
def test_busy_nodes_count_nodes_not_the_leases_they_hold(make_api: ApiFactory) -> None:
    # lease owners are `<node id>/<delivery>`: one node holding eight leases is one node
    api = make_api(target_start_s_interactive=2.0)
    ids = [submit(api).json()["id"] for _ in range(8)]
    for index, job_id in enumerate(ids):
        token = api.store.acquire_lease(job_id, f"dn1/{index:08x}")
        api.store.start(job_id, token)
    read = read_backlog(api.store, api.settings, "tiny")
    assert (read.running_jobs, read.busy_nodes, read.desired_nodes) == (8, 1, 1)
    view = httpx.get(f"{api.url}/v1/pipelines/tiny", headers=api.auth()).json()["backlog"]
    assert view["desired_nodes"] == 1
    # a backlog on top: the one busy node plus what the queue asks for
    for _ in range(21):
        submit(api)
    read = read_backlog(api.store, api.settings, "tiny")
    wanted = queue_nodes(21, read.queued_gpu_s, lane_targets(api.settings))
    assert read.busy_nodes == 1
    assert read.desired_nodes == 1 + wanted
    # a second node's lease adds a node
    extra = submit(api).json()["id"]
    api.store.start(extra, api.store.acquire_lease(extra, "dn2/00000000"))
    assert read_backlog(api.store, api.settings, "tiny").busy_nodes == 2


@pytest.mark.every_redis
def test_only_as_many_idle_nodes_as_are_surplus_claim_their_drain(job_store: JobStore) -> None:
    for node_id, running in (("idle-a", 0), ("idle-b", 0), ("busy-c", 1)):
        info = {"pipelines": ["tiny"], "jobs_running": running, "draining": False}
        job_store.publish_node(node_id, info, ttl_s=30)
    # three serve, two wanted: the first idle node to ask drains, the second stays
    assert job_store.claim_surplus("idle-a", {"tiny": 2}, "test")
    assert not job_store.claim_surplus("idle-b", {"tiny": 2}, "test")
    assert not job_store.claim_surplus("idle-a", {"tiny": 0}, "test")  # draining already
    drains = job_store.drain_requests()
    assert set(drains) == {"idle-a"}
    assert (drains["idle-a"].exit, drains["idle-a"].by) == (True, "test")
    # a node serving a second pipeline that still wants it is not surplus
    job_store.publish_node("both-d", {"pipelines": ["tiny", "other"]}, ttl_s=30)
    assert not job_store.claim_surplus("both-d", {"tiny": 0, "other": 1}, "test")


# --- exported by the API ------------------------------------------------------------------------
def test_a_job_for_a_pipeline_with_no_node_asks_for_one_at_once(api: Api) -> None:
    def desired() -> float:
        return scrape(api)[("kiln_pipeline_desired_nodes", (("pipeline", "tiny"),))]

    assert desired() == 0
    job = submit(api).json()
    assert "no live node serves pipeline 'tiny'" in (job["waiting_for"] or "")
    samples = scrape(api)
    assert desired() == 1
    assert samples[("kiln_pipeline_running_jobs", (("pipeline", "tiny"),))] == 0
    gpu_s = samples[
        ("kiln_pipeline_queued_gpu_seconds", (("lane", "interactive"), ("pipeline", "tiny")))
    ]
    assert gpu_s == api.settings.job_gpu_s_unknown  # no run ended yet: the unknown default
    assert samples[("kiln_pipeline_nodes", (("pipeline", "tiny"), ("state", "live")))] == 0
    view = httpx.get(f"{api.url}/v1/pipelines/tiny", headers=api.auth()).json()["backlog"]
    assert view["desired_nodes"] == 1
    assert view["queued"] == {"interactive": 1, "bulk": 0}
    assert view["nodes"] == {"live": 0, "asleep": 0, "draining": 0}
    assert view["expected_wait_s"] == {"interactive": None, "bulk": None}


def test_nodes_are_counted_from_heartbeats(api: Api) -> None:
    api.store.publish_node("n1", {"pipelines": ["tiny"], "asleep": True}, ttl_s=30)
    api.store.publish_node("n2", {"pipelines": ["tiny"], "draining": True}, ttl_s=30)
    api.store.publish_node("n3", {"pipelines": ["default"]}, ttl_s=30)
    samples = scrape(api)
    tiny = {
        state: samples[("kiln_pipeline_nodes", (("pipeline", "tiny"), ("state", state)))]
        for state in ("live", "asleep", "draining")
    }
    assert tiny == {"live": 2, "asleep": 1, "draining": 1}


# --- admission ------------------------------------------------------------------------------
def busy_pipeline(api: Api, queued: int) -> float:
    """Two runs just ended and `queued` interactive jobs wait; the lane's expected wait now."""
    done = [submit(api).json()["id"] for _ in range(2)]
    for job_id in done:
        drive_to_success(api.store, job_id)
    for _ in range(queued):
        assert submit(api).status_code == 201
    wait = read_backlog(api.store, api.settings, "tiny").expected_wait_s["interactive"]
    assert wait is not None
    return wait


def test_a_start_by_the_backlog_cannot_meet_is_a_429_with_retry_after(api: Api) -> None:
    keyed = {"Idempotency-Key": "late-1", **api.auth()}
    replayed = {**TINY, "start_by": time.time() + 5}
    assert httpx.post(f"{api.url}/v1/jobs", json=replayed, headers=keyed).status_code == 201
    wait = busy_pipeline(api, queued=40)  # 41 jobs ahead at <= 2 jobs/s: >= 20 s
    # the first post's backlog read (nothing had ended: no expected wait) answers admission for
    # ADMISSION_READ_S; on a fast machine the runs and the 40 submissions fit in it
    time.sleep(ADMISSION_READ_S)
    response = submit(api, start_by=time.time() + 5)
    assert response.status_code == 429, response.text
    detail = response.json()["detail"]
    assert "start_by" in detail
    assert "'tiny'" in detail
    assert int(response.headers["Retry-After"]) >= wait - 5 - 1  # ceil(wait - budget), then aged
    # the same deadline in the bulk lane, and a deadline the backlog meets, are accepted
    assert submit(api, start_by=time.time() + 5, priority="bulk").status_code == 201
    assert submit(api, start_by=time.time() + 3600).status_code == 201
    # a replay of a job accepted before the backlog grew gets that job, not a refusal
    assert httpx.post(f"{api.url}/v1/jobs", json=replayed, headers=keyed).status_code == 200


def test_the_lane_target_refuses_interactive_jobs_when_configured(make_api: ApiFactory) -> None:
    api = make_api(admit_by_target=True, target_start_s_interactive=5.0)
    busy_pipeline(api, queued=0)
    # accepted while the lane's expected wait is within 5 s (<= 2 jobs/s: some 10 jobs), then not;
    # the route reads the backlog at most once per ADMISSION_READ_S, so 20 submissions in a burst
    # may all be judged by the read before them: the next ones come after that read has aged out
    answers = [submit(api) for _ in range(20)]
    time.sleep(ADMISSION_READ_S)
    answers += [submit(api) for _ in range(20)]
    codes = [r.status_code for r in answers]
    assert codes[0] == 201
    assert 429 in codes, codes
    response = answers[codes.index(429)]
    assert "KILN_TARGET_START_S_INTERACTIVE" in response.json()["detail"]
    assert submit(api, priority="bulk").status_code == 201
    view = httpx.get(f"{api.url}/v1/pipelines/tiny", headers=api.auth()).json()["backlog"]
    assert view["expected_wait_s"]["interactive"] > 5
    assert view["target_start_s"] == {"interactive": 5.0, "bulk": 3600.0}


def test_without_a_deadline_nothing_is_refused_for_latency(api: Api) -> None:
    busy_pipeline(api, queued=40)
    assert submit(api).status_code == 201
