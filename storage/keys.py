"""Every Redis key Kiln uses, in one place: `{namespace}:...`.

Lua scripts receive these names (or the prefixes below) as arguments; they never invent keys.
Lifetimes: job-scoped keys (record, events, webhooks, idempotency entry) get `retention_s` when the
job reaches a terminal state and have no TTL while it is live; the lease key lives `lease_ttl_s`;
a node key lives its heartbeat TTL; index entries of expired records are skipped when read and
removed by `JobStore.prune_indexes` (from the `retired` set) or lazily by `list_jobs`.
"""

from __future__ import annotations

import re

# the events stream of a job is `job(id) + EVENTS_SUFFIX` (bulk creation builds it in Lua)
EVENTS_SUFFIX = ":events"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")


def valid_id(value: str) -> bool:
    """True if `value` may be a job or batch id (safe inside keys and object paths)."""
    return bool(_ID.fullmatch(value))


class Keys:
    """Key names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    # --- per job -------------------------------------------------------------------------------
    @property
    def job_prefix(self) -> str:
        """Prefix of job records (scripts complete it with an id read from another record)."""
        return f"{self.ns}:job:"

    def job(self, job_id: str) -> str:
        """Hash: the job record."""
        return self.job_prefix + job_id

    def events(self, job_id: str) -> str:
        """Stream of the job's events; entry ids are `<seq>-0`."""
        return self.job(job_id) + EVENTS_SUFFIX

    def lease(self, job_id: str) -> str:
        """String `<token>|<owner>` with the lease TTL."""
        return f"{self.ns}:job:{job_id}:lease"

    def cancel(self, job_id: str) -> str:
        """Flag set while a cancel of the running job is pending."""
        return f"{self.ns}:job:{job_id}:cancel"

    def webhooks(self, job_id: str) -> str:
        """List of webhook delivery attempts (JSON)."""
        return f"{self.ns}:job:{job_id}:webhooks"

    def job_scoped(self, job_id: str) -> list[str]:
        """The per-job keys every transition script takes, in its KEYS order."""
        return [
            self.job(job_id),
            self.events(job_id),
            self.lease(job_id),
            self.cancel(job_id),
            self.webhooks(job_id),
        ]

    # --- prefixes completed by scripts with an id read from the record -------------------------
    @property
    def idempotency_prefix(self) -> str:
        """Hash per idempotency key: job_id, fingerprint."""
        return f"{self.ns}:idem:"

    @property
    def batch_prefix(self) -> str:
        """Hash per batch: total, created_at, metadata, n_<state> counters."""
        return f"{self.ns}:batch:"

    @property
    def state_index_prefix(self) -> str:
        """Sorted set per state of job ids, scored by creation sequence."""
        return f"{self.ns}:idx:state:"

    @property
    def batch_index_prefix(self) -> str:
        """Sorted set per batch of job ids, scored by creation sequence."""
        return f"{self.ns}:idx:batch:"

    @property
    def owner_index_prefix(self) -> str:
        """Sorted set per owner of job ids, scored by creation sequence."""
        return f"{self.ns}:idx:owner:"

    def idempotency(self, key: str) -> str:
        """The idempotency entry of one key."""
        return self.idempotency_prefix + key

    def batch(self, batch_id: str) -> str:
        """The batch record."""
        return self.batch_prefix + batch_id

    def state_index(self, state: str) -> str:
        """Jobs in one state."""
        return self.state_index_prefix + state

    def batch_index(self, batch_id: str) -> str:
        """Jobs of one batch."""
        return self.batch_index_prefix + batch_id

    def owner_index(self, owner: str) -> str:
        """Jobs of one owner."""
        return self.owner_index_prefix + owner

    # --- global ----------------------------------------------------------------------------------
    @property
    def all_index(self) -> str:
        """Sorted set of every job id, scored by creation sequence."""
        return f"{self.ns}:idx:all"

    @property
    def retired(self) -> str:
        """Sorted set of finished jobs' index entries, scored by record expiry (s): pruned later."""
        return f"{self.ns}:retired"

    @property
    def creation_seq(self) -> str:
        """Counter giving each job a unique creation sequence (index score)."""
        return f"{self.ns}:creation_seq"

    @property
    def running(self) -> str:
        """Sorted set of running jobs scored by lease deadline (ms): the reaper's query."""
        return f"{self.ns}:running"

    @property
    def unpublished(self) -> str:
        """Sorted set of queued jobs whose Celery publish is unconfirmed, scored by time (s)."""
        return f"{self.ns}:unpublished"

    @property
    def queue_depth(self) -> str:
        """Counter of jobs in `queued`."""
        return f"{self.ns}:queue_depth"

    @property
    def node_prefix(self) -> str:
        """Prefix of node heartbeats."""
        return f"{self.ns}:node:"

    def node(self, node_id: str) -> str:
        """A node's heartbeat (JSON) with its TTL."""
        return self.node_prefix + node_id

    @property
    def nodes(self) -> str:
        """Sorted set of node ids scored by heartbeat deadline (ms)."""
        return f"{self.ns}:nodes"

    # --- API keys ------------------------------------------------------------------------------
    def api_key(self, key_hash: str) -> str:
        """Hash: one API key record, found by the hash of the secret."""
        return f"{self.ns}:apikey:{key_hash}"

    def api_key_id(self, key_id: str) -> str:
        """String: key id → key hash."""
        return f"{self.ns}:apikey_id:{key_id}"

    @property
    def api_key_ids(self) -> str:
        """Set of every API key id."""
        return f"{self.ns}:apikeys"
