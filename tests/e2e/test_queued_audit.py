"""A queued job whose message is lost is run once by a real node: after the audit age or a lapse.

kombu pops a message with BRPOP and records it as unacknowledged one pipeline later: a node
killed between the two, or a connection lost with the reply in flight, loses the message while
its job stays `queued` and published (tasks/control/audit.py). The test makes that state directly:
the job is created with a publish that sends nothing, so its record is marked published with no
message anywhere. No sweeper, held list or visibility timeout would bring it back; the audit does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kiln.tasks.contract.schemas import JobRequest
from kiln.tasks.intake.intake import Intake
from kiln.tasks.queue.app import transport_options
from kiln.tasks.queue.submit import Submitter, job_queue
from tests.e2e.cluster import SLEEPY, Cluster
from tests.waiting import wait_for_changes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AUDIT_ENV = {
    "KILN_TEST_STEP_SECONDS": "0.01",
    "KILN_QUEUED_AUDIT_AGE_S": "2",
    "KILN_QUEUED_AUDIT_INTERVAL_S": "1",
}
AUDITED = "queued, its message in no queue"  # the audit's log line for a job it publishes
REQUEST = JobRequest(pipeline="sleepy", prompt="x", width=64, height=64, steps=2)


def test_a_job_whose_message_was_lost_runs_once_after_the_audit_age(
    cluster_factory: Callable[..., Cluster],
) -> None:
    cluster = cluster_factory()
    sends_nothing = Submitter(cluster.store, cluster.settings, lambda *_: None)
    lost, _ = Intake(sends_nothing, None).submit(REQUEST)
    record = cluster.store.get(lost.id)
    assert record.published
    options = transport_options(cluster.settings, cluster.storage_settings.redis_namespace)
    queue_key = str(options["global_keyprefix"]) + job_queue(record)
    assert cluster.store.redis.llen(queue_key) == 0  # the message is nowhere

    # a job published twice: the second message must not run it again (hold refuses a job no
    # longer queued)
    twice, _ = Intake(sends_nothing, None).submit(REQUEST)
    cluster.submitter.publish(twice)
    cluster.submitter.publish(twice)

    started = time.monotonic()
    worker = cluster.start_worker(f"sleepy={SLEEPY}", extra_env=AUDIT_ENV)
    for job_id in (lost.id, twice.id):
        finished = cluster.wait_for(job_id, timeout_s=90)
        assert str(finished.state) == "succeeded", finished.error
        assert finished.attempts == 1
        assert cluster.completion_count(job_id) == 1
    print(f"lost message recovered {time.monotonic() - started:.1f}s after the node started")
    log = worker.output()
    assert f"job {lost.id}: {AUDITED}" in log
    assert f"job {twice.id}: {AUDITED}" not in log
    # the duplicate's leftovers are dropped, never run: still once after the audit's next passes
    audits = cluster.store.keys.queued_audits  # queue -> when a node last claimed its audit
    wait_for_changes(
        lambda: cluster.store.redis.hget(audits, job_queue(twice)), 2, what="two audit passes"
    )
    assert cluster.completion_count(twice.id) == 1
    assert cluster.completion_count(lost.id) == 1


def test_a_message_lost_as_a_node_died_runs_soon_after_its_lapse_not_the_audit_age(
    cluster_factory: Callable[..., Cluster],
) -> None:
    # The deployment's audit settings (every 120 s, jobs queued over 300 s): only the lapse of
    # the node that took the message can bring the job back within the wait below.
    cluster = cluster_factory(KILN_TEST_STEP_SECONDS="0.01")
    worker = cluster.start_worker(f"sleepy={SLEEPY}")
    sends_nothing = Submitter(cluster.store, cluster.settings, lambda *_: None)
    # its message popped by a node, then killed...
    lost, _ = Intake(sends_nothing, None).submit(REQUEST)
    # ...before kombu recorded the delivery or the node listed it: its held list lapses empty
    cluster.store.record_held("node-killed", [], ttl_s=0.5)
    started = time.monotonic()
    finished = cluster.wait_for(lost.id, timeout_s=60)
    assert str(finished.state) == "succeeded", finished.error
    assert finished.attempts == 1
    assert cluster.completion_count(lost.id) == 1
    print(f"lost message recovered {time.monotonic() - started:.1f}s after the lapse began")
    lapse = cluster.store.redis.hgetall(cluster.store.keys.last_lapse)
    assert int(lapse["claimed_ms"]) > 0, lapse  # the lapse was claimed...
    log = worker.output()  # ...and said so, though maybe before Celery set its logging up
    assert "node node-killed lapsed holding 0 listed message(s)" in log
    assert f"job {lost.id}: {AUDITED}" in log
