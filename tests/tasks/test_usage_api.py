"""The ledger where users read it, over a real API and store.

A job's view and result line, `GET /v1/usage` (scoped to the caller's key, admin keys seeing
every key's and the nodes'), hostile query parameters, and `kiln_gpu_seconds_total`.
"""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.common.accounting import AttemptSteps
from kiln.common.ledger import AttemptUsage, JobLedger
from kiln.storage.usage import add_node_usage
from kiln.tasks.batches.results import job_line
from kiln.tasks.contract.events import SucceededEvent, parse_event
from tests.tasks.helpers import Api, start_job
from tests.tasks.test_finished_counters import scrape

HANDED_BACK = {"type": "handed_back", "message": "the node shut down", "retryable": True}


def submit(api: Api, who: str, pipeline: str = "tiny") -> str:
    body = {"prompt": "counted", "pipeline": pipeline}
    answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth(who))
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def ran(gpu_s: float, pipeline: str = "tiny") -> AttemptSteps:
    usage = AttemptUsage(pipeline=pipeline, gpu_s=gpu_s, computing_s=gpu_s / 2, encoding_s=0.1)
    return AttemptSteps(0, 4, 0.1, usage=usage.as_dict())


def usage(api: Api, who: str, **params: str) -> httpx.Response:
    return httpx.get(f"{api.url}/v1/usage", params=params, headers=api.auth(who))


def test_the_view_the_result_line_and_the_event_show_the_job_s_ledger(api: Api) -> None:
    store = api.store
    job_id = submit(api, "alice")
    view = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth()).json()
    assert view["ledger"] == JobLedger().model_dump()  # it has not run yet
    token = start_job(store, job_id)
    store.requeue(job_id, token, HANDED_BACK, ran(1.25))
    token = start_job(store, job_id)
    store.succeed(job_id, token, [], {}, ran(2.5))

    view = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth()).json()
    ledger = JobLedger.model_validate(view["ledger"])
    assert (ledger.gpu_s, ledger.computing_s, ledger.encoding_s) == (3.75, 1.875, 0.2)
    assert ledger.energy_j is None  # no NVML here
    line = json.loads(job_line(0, "line-0", job_id, store.get(job_id), None))
    assert JobLedger.model_validate(line["ledger"]) == ledger
    (*_, last) = (parse_event(e) for e in store.events(job_id, count=100))
    assert isinstance(last, SucceededEvent)
    assert last.payload.ledger == ledger


def test_a_key_sees_its_own_usage_and_an_admin_every_key_s_and_the_nodes(api: Api) -> None:
    store = api.store
    metric = ("kiln_gpu_seconds_total", (("owner", api.key_ids["alice"]), ("pipeline", "tiny")))
    before = scrape(api).get(metric, 0.0)
    for who, gpu_s in (("alice", 1.0), ("alice", 2.0), ("bob", 4.0)):
        job_id = submit(api, who)
        store.succeed(job_id, start_job(store, job_id), [], {}, ran(gpu_s))
    add_node_usage(store, "node-x", held_gpu_s=9.0, busy_gpu_s=7.0)

    alice = usage(api, "alice", since="1h")
    assert alice.status_code == 200, alice.text
    body = alice.json()
    assert [(r["key_id"], r["gpu_s"], r["attempts"]) for r in body["rows"]] == [
        (api.key_ids["alice"], 3.0, 2)
    ]
    assert body["nodes"] == []
    bob = usage(api, "bob", group_by="pipeline").json()
    assert [(r["pipeline"], r["gpu_s"]) for r in bob["rows"]] == [("tiny", 4.0)]

    admin = usage(api, "admin", since="1h").json()
    by_key = {r["key_id"]: r["gpu_s"] for r in admin["rows"]}
    assert by_key == {api.key_ids["alice"]: 3.0, api.key_ids["bob"]: 4.0}
    assert [(n["node_id"], n["idle_gpu_s"]) for n in admin["nodes"]] == [("node-x", 2.0)]
    assert scrape(api)[metric] - before == 3.0


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"since": "1h", "until": "2h"}, "since"),  # since after until
        ({"since": "nan"}, "since"),
        ({"until": "inf"}, "until"),
        ({"since": "1e400"}, "since"),
        ({"since": "9" * 60}, "since"),
        ({"since": "-1"}, "since"),
        ({"since": "3650d"}, "since"),  # longer than the buckets are kept
        ({"until": "next tuesday"}, "until"),
        ({"group_by": "owner"}, "group_by"),
        ({"since": "x" * 65}, "since"),  # over the length limit
        ({"group_by": "key", "owner": "someone"}, "owner"),  # no such parameter
    ],
)
def test_a_hostile_query_is_a_4xx_naming_the_parameter(
    api: Api, params: dict[str, str], names: str
) -> None:
    answer = usage(api, "admin", **params)
    assert 400 <= answer.status_code < 500, answer.text
    assert names in answer.text


def test_usage_needs_a_key(api: Api) -> None:
    assert httpx.get(f"{api.url}/v1/usage").status_code == 401
