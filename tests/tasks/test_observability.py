"""The pieces behind metrics, JSON logs and Celery task states, one at a time.

tests/e2e/test_observability.py runs them together on a real node and API.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from celery.exceptions import Ignore, Retry
from prometheus_client.parser import text_string_to_metric_families

from kiln.common.logs import is_json_object, log_context, make_handler
from kiln.gpu_worker.counters import GroupCounters
from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.node.metrics import group_families
from kiln.tasks.node.outcomes import (
    Delivery,
    DeliveryOutcome,
    JobFailedError,
    settle_task,
)
from tests.tasks.helpers import Api


@pytest.fixture
def json_log() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    logger = logging.getLogger("kiln.test.observability")
    handler = make_handler("json", stream, static={"node_id": "node-1", "batch_id": None})
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_json_line_carries_the_context_where_known(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = json_log
    logger.info("outside")
    with log_context(job_id="job-1", attempt=2, batch_id=None):
        logger.warning("inside %s", "a job")
        logger.info("explicit", extra={"job_id": "job-2"})
    outside, inside, explicit = lines(stream)
    assert list(outside)[:4] == ["time", "level", "logger", "message"]
    assert outside["time"].endswith("+00:00")
    assert outside == {**outside, "level": "INFO", "message": "outside", "node_id": "node-1"}
    assert "job_id" not in outside
    assert "batch_id" not in inside  # unknown: left out, never null
    assert inside["message"] == "inside a job"
    assert (inside["level"], inside["job_id"], inside["attempt"]) == ("WARNING", "job-1", 2)
    assert explicit["job_id"] == "job-2"  # what the call passes wins over the context


def test_an_exception_is_part_of_its_json_line(
    json_log: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = json_log
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("it broke")
    (line,) = lines(stream)
    assert "ValueError: boom" in line["exc_info"]


def test_only_json_objects_pass_through_the_captured_output() -> None:
    assert is_json_object('{"level": "INFO"}')
    assert not is_json_object("[1, 2]")
    assert not is_json_object("{not json")
    assert not is_json_object("worker: Warm shutdown (MainProcess)")


class FakeTask:
    """What `settle_task` uses of a bound Celery task."""

    def __init__(self, events: bool) -> None:
        self.request = SimpleNamespace(id="task-1")
        self.app = SimpleNamespace(conf=SimpleNamespace(worker_send_task_events=events))
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.revoked: list[str] = []
        self.backend = SimpleNamespace(mark_as_revoked=self._mark_revoked)

    def send_event(self, type_: str, **fields: Any) -> None:
        self.sent.append((type_, fields))

    def _mark_revoked(self, task_id: str, reason: str, request: Any = None) -> None:
        del request
        self.revoked.append(f"{task_id}:{reason}")


ERROR = {"type": "pipeline_error", "message": "it broke", "retryable": False}


def test_a_failed_job_fails_its_task_with_the_jobs_error() -> None:
    with pytest.raises(JobFailedError, match="pipeline_error: it broke"):
        settle_task(FakeTask(events=True), DeliveryOutcome(Delivery.FAILED, ERROR))


@pytest.mark.parametrize(
    ("kind", "expired"), [(Delivery.CANCELED, False), (Delivery.EXPIRED, True)]
)
def test_a_canceled_or_expired_job_revokes_its_task(kind: Delivery, expired: bool) -> None:
    task = FakeTask(events=True)
    with pytest.raises(Ignore):
        settle_task(task, DeliveryOutcome(kind))
    assert task.sent == [
        ("task-revoked", {"terminated": False, "signum": None, "expired": expired})
    ]
    assert task.revoked == [f"task-1:{kind}"]


def test_without_task_events_a_revoke_sends_no_event() -> None:
    task = FakeTask(events=False)
    with pytest.raises(Ignore):
        settle_task(task, DeliveryOutcome(Delivery.CANCELED))
    assert task.sent == []


def test_a_requeued_job_marks_its_task_retry() -> None:
    with pytest.raises(Retry) as raised:
        settle_task(FakeTask(events=True), DeliveryOutcome(Delivery.RETRYING, ERROR, 2.0))
    assert raised.value.when == 2.0
    assert "it broke" in str(raised.value.exc)


@pytest.mark.parametrize(
    "kind", [Delivery.SUCCEEDED, Delivery.DEFERRED, Delivery.LEASE_LOST, Delivery.DROPPED]
)
def test_every_other_delivery_succeeds_saying_what_it_did(kind: Delivery) -> None:
    assert settle_task(FakeTask(events=True), DeliveryOutcome(kind)) == str(kind)


def test_the_group_counters_become_node_series() -> None:
    counters = GroupCounters()
    counters.add_forward("tiny", steps_run=8, batch_size=3, peak_mb=2.0)
    counters.add_forward("tiny", steps_run=8, batch_size=1, peak_mb=1.5)
    counters.add_forward("tiny", steps_run=0, batch_size=0, peak_mb=0.0)  # all refused: nothing
    counters.add_rebuild("rank_died")
    families = {f.name: f for f in group_families("n1", "cpu:2", counters)}
    steps = families["kiln_node_denoise_steps"].samples
    assert [(s.labels, s.value) for s in steps] == [({"node_id": "n1", "pipeline": "tiny"}, 32)]
    buckets = {
        s.labels["le"]: s.value
        for s in families["kiln_node_batch_size"].samples
        if s.name.endswith("_bucket")
    }
    assert (buckets["1"], buckets["2"], buckets["4"], buckets["+Inf"]) == (1, 1, 2, 2)
    (peak,) = families["kiln_node_peak_memory_bytes"].samples
    assert peak.labels == {"node_id": "n1", "device": "cpu:2"}
    assert peak.value == 1.5 * 1024 * 1024  # the last forward's
    (rebuilds,) = families["kiln_node_group_rebuilds"].samples
    assert (rebuilds.labels["reason"], rebuilds.value) == ("rank_died", 1)


def scrape(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{api.url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_api_requests_are_counted_by_route_template(api: Api) -> None:
    headers = api.auth()
    assert httpx.get(f"{api.url}/v1/jobs/{'0' * 32}", headers=headers).status_code == 404
    assert httpx.get(f"{api.url}/no/such/route").status_code == 404
    job = JobRequest(prompt="counted", pipeline="tiny").model_dump(mode="json", exclude_none=True)
    assert httpx.post(f"{api.url}/v1/jobs", json=job, headers=headers).status_code == 201
    samples = scrape(api)

    def requests(route: str, status: str) -> float:
        return samples.get(("kiln_api_requests_total", (("route", route), ("status", status))), 0.0)

    assert requests("/v1/jobs/{job_id}", "404") == 1
    assert requests("unmatched", "404") == 1
    assert requests("/v1/jobs", "201") == 1
    assert samples[("kiln_api_submit_duration_seconds_count", ())] == 1
    assert samples[("kiln_jobs", (("state", "queued"),))] == 1
    assert samples[("kiln_queue_depth", (("queue", "interactive.tiny"),))] == 1
    assert samples[("kiln_queue_depth", (("queue", "webhooks"),))] == 0
    assert "/metrics" not in httpx.get(f"{api.url}/openapi.json").json()["paths"]


def test_replica_groups_add_their_counters_up() -> None:
    one, two = GroupCounters(busy_s=1.0), GroupCounters(busy_s=2.5)
    one.add_forward("tiny", steps_run=4, batch_size=2, peak_mb=3.0)
    two.add_forward("tiny", steps_run=4, batch_size=1, peak_mb=5.0)
    two.add_rebuild("killed")
    total = GroupCounters.merged([one, two])
    assert (total.busy_s, total.steps, total.batch_sizes) == (3.5, {"tiny": 12}, {2: 1, 1: 1})
    assert (total.peak_memory_mb, total.rebuilds) == (5.0, {"killed": 1})
