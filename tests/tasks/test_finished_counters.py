"""The API's counters of finished jobs, batch lines and batches: right after the records expire.

Jobs are submitted through a real API and moved through the real store (every terminal path:
transition, cancel, reap); their records then expire and the indexes are pruned, as in
production. `kiln_jobs{state}` (a gauge over records) drops back to 0; the counters do not.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.storage.batch_store import BatchFeeding, BatchStore, FedWrite, NewFedBatch
from kiln.storage.errors import StorageError
from kiln.storage.job_store import JobStore
from kiln.storage.records import NewJob
from kiln.tasks.contract.schemas import JobRequest
from tests.tasks.helpers import Api, ApiFactory, drive_to_success, start_job
from tests.waiting import wait_until

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
RETENTION_S = 1  # finished records expire a second after they end


def scrape(api: Api) -> Samples:
    text = httpx.get(f"{api.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def finished(samples: Samples, pipeline: str, lane: str, state: str) -> float:
    labels = (("lane", lane), ("pipeline", pipeline), ("state", state))
    return samples[("kiln_jobs_finished_total", labels)]  # every known series is exported


def submit(api: Api, pipeline: str, priority: str = "interactive") -> str:
    job = JobRequest.model_validate(
        {"prompt": "counted", "pipeline": pipeline, "priority": priority}
    )
    body = job.model_dump(mode="json", exclude_none=True)
    answer = httpx.post(f"{api.url}/v1/jobs", json=body, headers=api.auth())
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def batch_line(store: JobStore, batch_id: str, line: int) -> str:
    job_id = f"{batch_id}-{line}"
    body = JobRequest(prompt=f"line {line}", pipeline="tiny").to_record()
    store.create_job(NewJob(id=job_id, request=body, batch_id=batch_id, queue="bulk.tiny"))
    return job_id


def wait_until_records_expire(store: JobStore, job_ids: list[str]) -> None:
    """Poll until every record is gone (retention), then prune their index entries."""
    wait_until(
        lambda: [j for j in job_ids if store.redis.exists(store.keys.job(j))],
        lambda left: not left,
        timeout_s=30,
        what="records expired",
    )
    store.prune_indexes()


@pytest.fixture
def short_lived(make_api: ApiFactory) -> Api:
    return make_api(storage={"retention_s": RETENTION_S})


def test_finished_jobs_are_counted_once_and_outlive_their_records(
    short_lived: Api, make_api: ApiFactory
) -> None:
    api, store = short_lived, short_lived.store
    succeeded = [submit(api, "tiny") for _ in range(3)]
    for job_id in succeeded:
        drive_to_success(store, job_id)
    failed = submit(api, "tiny-video", priority="bulk")
    store.fail(failed, start_job(store, failed), {"type": "X", "message": "no"})
    canceled_queued = submit(api, "tiny")
    assert httpx.post(f"{api.url}/v1/jobs/{canceled_queued}/cancel", headers=api.auth()).is_success
    reaped = submit(api, "tiny")  # running, cancel asked, lease lost: the reaper cancels it
    start_job(store, reaped)
    store.cancel(reaped)
    store.redis.delete(store.keys.lease(reaped))
    assert store.reap(reaped)
    fed_batch(BatchStore(store.redis, store.settings), "b-counted", items=2)
    line_ok, line_expired = batch_line(store, "b-counted", 1), batch_line(store, "b-counted", 2)
    drive_to_success(store, line_ok)
    store.expire(line_expired)

    before = scrape(api)
    assert before[("kiln_jobs", (("state", "succeeded"),))] == 4

    # A retried terminal transition (a node retrying its write) is refused and counts nothing.
    with pytest.raises(StorageError):
        drive_to_success(store, succeeded[0])
    with pytest.raises(StorageError):
        store.expire(line_expired)
    ended = [*succeeded, failed, canceled_queued, reaped, line_ok, line_expired]
    wait_until_records_expire(store, ended)

    for samples in (scrape(api), scrape(make_api())):  # any API process reads the same counts
        assert samples[("kiln_jobs", (("state", "succeeded"),))] == 0  # the gauge: records
        assert finished(samples, "tiny", "interactive", "succeeded") == 3
        assert finished(samples, "tiny", "bulk", "succeeded") == 1  # the batch line
        assert finished(samples, "tiny-video", "bulk", "failed") == 1
        assert finished(samples, "tiny", "interactive", "canceled") == 2
        assert finished(samples, "tiny", "bulk", "expired") == 1
        assert finished(samples, "default", "interactive", "succeeded") == 0  # known: from 0
        lines = {
            state: samples[("kiln_batch_lines_finished_total", (("state", state),))]
            for state in ("succeeded", "failed", "canceled", "expired")
        }
        assert lines == {"succeeded": 1, "failed": 0, "canceled": 0, "expired": 1}
        assert samples == {**samples, **{k: v for k, v in before.items() if "finished" in k[0]}}


def fed_batch(batches: BatchStore, batch_id: str, items: int = 1) -> None:
    new = NewFedBatch(
        id=batch_id,
        input_key=f"batches/{batch_id}/input.jsonl",
        items=items,
        lines=items,
        invalid=0,
        window_s=3600,
    )
    batches.submit_fed_batch(new)


def test_batches_are_gauged_while_live_and_counted_once_when_they_end(api: Api) -> None:
    store = api.store
    batches = BatchStore(store.redis, store.settings)
    feeding = BatchFeeding(store.redis, store.settings)
    fed_batch(batches, "b-live")
    fed_batch(batches, "b-ends")
    lease = (feeding.take_feeder("b-ends", "node-a"), "node-a")
    assert feeding.record_fed("b-ends", lease, 0, (1, 10), [("b-ends-1", 1)]) is FedWrite.applied
    assert feeding.record_reported("b-ends", lease, "part", ["b-ends-1"], 60)
    assert feeding.finish_fed("b-ends", lease, "completed", "summary")
    assert not feeding.finish_fed("b-ends", lease, "completed", "summary")  # a retried finish
    store.redis.delete(store.keys.batch("b-ends"))  # its record expired

    samples = scrape(api)
    assert samples[("kiln_batches", (("state", "running"),))] == 1
    assert ("kiln_batches", (("state", "finalizing"),)) not in samples
    assert samples[("kiln_batches_finished_total", (("state", "completed"),))] == 1
