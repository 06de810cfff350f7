"""A job's step accounting where users and operators read it: its view, its result line, metrics.

A job submitted through a real API runs two attempts in the real store (the first handed back
after 12 steps with no checkpoint, the second from step 0 to 40): every reader shows the one
figure storage wrote.
"""

from __future__ import annotations

import json

import httpx

from kiln.common.accounting import AttemptSteps, StepAccounting
from kiln.tasks.batches.results import job_line
from kiln.tasks.contract.events import SucceededEvent, parse_event
from tests.tasks.helpers import Api, start_job
from tests.tasks.test_finished_counters import scrape, submit

HANDED_BACK = {"type": "handed_back", "message": "the node shut down", "retryable": True}
EXPECTED = StepAccounting(
    steps_computed=52, steps_restored=0, steps_recomputed=12, seconds_lost=1.5
)


def steps_total(api: Api, name: str) -> float:
    labels = (("lane", "interactive"), ("pipeline", "tiny"))
    return scrape(api)[(f"kiln_{name}_total", labels)]  # every known series is exported


def test_the_view_a_result_line_and_the_counters_show_the_jobs_accounting(api: Api) -> None:
    store = api.store
    names = ("steps_computed", "steps_restored", "steps_recomputed", "seconds_lost")
    before = {name: steps_total(api, name) for name in names}
    job_id = submit(api, "tiny")
    view = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth()).json()
    assert view["accounting"] == StepAccounting().model_dump()  # it has not run yet

    token = start_job(store, job_id)
    store.requeue(job_id, token, HANDED_BACK, AttemptSteps(restored=0, reached=12, step_s=0.25))
    token = start_job(store, job_id)
    store.succeed(job_id, token, [], {}, AttemptSteps(restored=0, reached=40, step_s=0.125))

    view = httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=api.auth()).json()
    assert StepAccounting.model_validate(view["accounting"]) == EXPECTED
    line = json.loads(job_line(0, "line-0", job_id, store.get(job_id), None))
    assert StepAccounting.model_validate(line["accounting"]) == EXPECTED
    # the typed event a webhook reports: the terminal one carries the job's figures
    (*_, last) = (parse_event(e) for e in store.events(job_id, count=100))
    assert isinstance(last, SucceededEvent)
    assert last.payload.accounting == EXPECTED
    grown = {name: steps_total(api, name) - before[name] for name in names}
    assert grown == EXPECTED.model_dump()
