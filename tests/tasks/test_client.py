"""KilnClient against a real API server: typed results and one clear error per failure."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kiln.tasks.client.client import (
    Forbidden,
    IdempotencyConflictError,
    JobNotFoundError,
    KilnClient,
    KilnConnectionError,
    QueueFull,
    Unauthorized,
    ValidationFailed,
    WaitTimeout,
)
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.contract.views import JobView
from tests.tasks.helpers import Api, ApiFactory, drive_to_success
from tests.waiting import wait_until

REQUEST = JobRequest(prompt="a kiln", width=64, height=64, steps=2)


def client_for(api: Api, who: str = "alice") -> KilnClient:
    return KilnClient(api.url, api.keys[who], timeout=30)


def test_submit_get_cancel_typed(api: Api) -> None:
    with client_for(api) as client:
        job = client.submit(REQUEST, idempotency_key="c-1")
        assert isinstance(job, JobView)
        assert job.status == "queued"
        assert client.submit(REQUEST, idempotency_key="c-1").id == job.id
        assert client.get(job.id).parameters.prompt == "a kiln"
        result = client.cancel(job.id)
        assert result.effect == "canceled"
        assert result.job.status == "canceled"
        page = client.list(status="canceled")
        assert [j.id for j in page.jobs] == [job.id]
        assert client.webhooks(job.id).attempts == []


def test_wait_and_events(api: Api) -> None:
    with client_for(api) as client:
        job = client.submit(REQUEST)
        threading.Timer(0.3, drive_to_success, args=(api.store, job.id)).start()
        done = client.wait(job.id, timeout=60, poll_s=0.1)
        assert done.status == "succeeded"
        assert done.outputs[0].url
        events = list(client.events(job.id))
        assert [e.type for e in events][-1] == "succeeded"
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert next(e.seq for e in client.events(job.id, after=2)) == 3


def test_wait_timeout_keeps_the_last_view(api: Api) -> None:
    with client_for(api) as client:
        job = client.submit(REQUEST)
        started = time.monotonic()
        with pytest.raises(WaitTimeout) as caught:
            client.wait(job.id, timeout=0.3, poll_s=0.1)
        assert caught.value.job is not None
        assert caught.value.job.status == "queued"
        assert time.monotonic() - started < 30


def test_clear_errors(make_api: ApiFactory) -> None:
    api = make_api(max_queue_depth=1, queue_full_retry_after_s=3)
    with client_for(api) as client:
        with pytest.raises(JobNotFoundError):
            client.get("no-such-job")
        with pytest.raises(ValidationFailed) as invalid:
            client.submit({"prompt": "p", "width": 65})
        assert "body.width" in invalid.value.fields
        job = client.submit(REQUEST, idempotency_key="same")
        with pytest.raises(QueueFull) as full:
            client.submit(REQUEST)
        assert full.value.retry_after == 3.0
        client.cancel(job.id)  # frees the queue
        with pytest.raises(IdempotencyConflictError):
            client.submit({"prompt": "other", "width": 64, "height": 64}, idempotency_key="same")
    with client_for(api, "bob") as bob, pytest.raises(Forbidden):
        bob.get(job.id)
    with KilnClient(api.url, "kiln_wrong") as stranger, pytest.raises(Unauthorized):
        stranger.get(job.id)
    with KilnClient("http://127.0.0.1:9", None, timeout=2) as nowhere:
        with pytest.raises(KilnConnectionError):
            nowhere.get("x")
        with pytest.raises(KilnConnectionError):
            list(nowhere.events("x"))


def test_outputs_nodes_and_pipelines(api: Api, tmp_path: Path) -> None:
    from tests.tasks.test_cli_batch import finish

    with client_for(api) as client:
        job = client.submit(REQUEST)
        finish(api, job.id)
        report = client.download_outputs(job.id, tmp_path)
        assert (report.downloaded, report.kept, report.failed) == (1, 0, [])
        assert (tmp_path / f"{job.id}-0.png").read_bytes() == f"pixels of {job.id}".encode()
        assert client.download_outputs(job.id, tmp_path).kept == 1  # present: kept, not fetched
        assert client.output_url(job.id, 0) == f"{api.url}/v1/jobs/{job.id}/outputs/0"
        api.store.publish_node("node-x", {"pipelines": ["grad"]}, 60)
        wait_until(  # the API reads the heartbeats again after a moment
            lambda: client.pipelines().pipelines,
            lambda names: "grad" in names,
            timeout_s=30,
            what="the announced pipeline listed",
        )
        assert [node["node_id"] for node in client.nodes().nodes] == ["node-x"]
