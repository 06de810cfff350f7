"""The job store: job records, the state machine, leases, events and counters in Redis.

Key names live in storage/keys.py, the Lua scripts in storage/lua/ (loaded by storage/scripts.py);
this module assembles the store from its parts, one per concept. Each part is a store of its own
on `StoreBase` (no part leans on another): a caller that uses one concept takes that one (a
backlog read takes `BacklogOps`, the served pipelines `NodeOps`, a queue position `QueueOps`),
and any `JobStore` is one; a part built alone shares the process's client: `QueryOps(store.redis,
store.settings)`. `JobStore` is for callers of many concepts.
"""

from __future__ import annotations

from kiln.storage.audit import AuditOps
from kiln.storage.backlog import BacklogOps
from kiln.storage.base import StoreBase, redis_client
from kiln.storage.creation import DEFAULT_CHUNK, CreationOps, request_fingerprint
from kiln.storage.leases import LeaseOps
from kiln.storage.nodes import NodeOps
from kiln.storage.publish_confirmation import PublishConfirmationOps
from kiln.storage.queries import QueryOps
from kiln.storage.queues import QueueOps
from kiln.storage.records import JobEvent, JobRecord, NewJob
from kiln.storage.settings import StorageSettings
from kiln.storage.transitions import TransitionOps
from kiln.storage.webhook_attempts import WebhookAttemptOps

__all__ = [
    "DEFAULT_CHUNK",
    "JobEvent",
    "JobRecord",
    "JobStore",
    "NewJob",
    "request_fingerprint",
]


class JobStore(
    CreationOps,
    TransitionOps,
    LeaseOps,
    QueryOps,
    QueueOps,
    PublishConfirmationOps,
    WebhookAttemptOps,
    NodeOps,
    AuditOps,
    BacklogOps,
    StoreBase,
):
    """Every Redis read and write of Kiln's job state goes through here."""

    @classmethod
    def from_settings(cls, settings: StorageSettings) -> JobStore:
        """A store with its own client for `settings.redis_url`."""
        return cls(redis_client(settings), settings)
