"""The job store's concepts are stores of their own: each stands on StoreBase alone.

A caller that uses one concept takes that one (`read_backlogs` a `BacklogOps`, `served_now` a
`NodeOps`, `queue_estimate` a `QueueOps`); `JobStore` composes them for callers of many. Built
on one Redis client and settings, each sees what the others wrote.
"""

from __future__ import annotations

import inspect

from kiln.common.states import JobState
from kiln.storage.audit import AuditOps
from kiln.storage.backlog import BacklogOps
from kiln.storage.base import StoreBase
from kiln.storage.creation import CreationOps
from kiln.storage.job_store import JobStore
from kiln.storage.leases import LeaseOps
from kiln.storage.nodes import NodeOps
from kiln.storage.publish_confirmation import PublishConfirmationOps
from kiln.storage.queries import QueryOps
from kiln.storage.queues import QueueOps
from kiln.storage.transitions import TransitionOps
from kiln.storage.webhook_attempts import WebhookAttemptOps
from tests.storage.helpers import WORKER, new_job

*CONCEPTS, BASE = JobStore.__bases__
QUEUE = "interactive.sleepy"


def public_methods(concept: type) -> set[str]:
    """The public methods a concept declares itself (not those of StoreBase)."""
    return {
        name
        for name, member in vars(concept).items()
        if not name.startswith("_") and inspect.isfunction(member)
    }


def test_job_store_is_the_concepts_and_nothing_more() -> None:
    assert BASE is StoreBase
    assert len(CONCEPTS) == 10
    for concept in CONCEPTS:  # none leans on another: each is usable alone
        assert concept.__bases__ == (StoreBase,), concept
    own = {name for name, member in vars(JobStore).items() if inspect.isfunction(member)}
    assert own <= {"from_settings"}  # no method of its own: a caller's method is a concept's


def test_no_two_concepts_name_the_same_method() -> None:
    seen: dict[str, type] = {}
    for concept in CONCEPTS:
        for name in public_methods(concept):
            assert name not in seen, f"{name} in {seen.get(name)} and {concept}"
            seen[name] = concept


def test_concepts_on_one_client_see_each_others_writes(job_store: JobStore) -> None:
    client, settings = job_store.redis, job_store.settings
    creation, transitions = CreationOps(client, settings), TransitionOps(client, settings)
    queries, queues = QueryOps(client, settings), QueueOps(client, settings)

    record, created = creation.create_job(new_job(queue=QUEUE))
    assert created
    assert queries.get(record.id).state == JobState.QUEUED
    assert queues.queued_counts([QUEUE]) == {QUEUE: 1}
    assert BacklogOps(client, settings).backlog([QUEUE]).queues[QUEUE].queued == 1

    token, _ = transitions.hold(record.id, WORKER, "node-1", 0)
    assert LeaseOps(client, settings).lease_owner(record.id) == WORKER
    assert AuditOps(client, settings).leased([record.id]) == {record.id}
    assert transitions.start(record.id, token, node_id="node-1").state == JobState.RUNNING

    attempts = WebhookAttemptOps(client, settings)
    attempts.record_webhook_attempt(record.id, {"attempt": 1, "outcome": "delivered"})
    assert attempts.webhook_attempts(record.id) == [{"attempt": 1, "outcome": "delivered"}]
    PublishConfirmationOps(client, settings).mark_published(record.id)

    nodes = NodeOps(client, settings)
    nodes.publish_node("node-1", {"pipelines": ["sleepy"]}, ttl_s=30)
    assert [node["node_id"] for node in nodes.live_nodes()] == ["node-1"]
    transitions.succeed(record.id, token, [{"key": "k"}], {"run_s": 0.1})
    assert job_store.get(record.id).state == JobState.SUCCEEDED  # the composition sees it too
