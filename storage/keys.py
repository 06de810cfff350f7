"""Every Redis key Kiln uses, in one place: `{namespace}:...`.

Each key name is built here, by one documented entry, and nowhere else: Python passes the names
to the Lua scripts (storage/lua/) as KEYS. A script that must find a key from data it reads in
Redis (an id in a set, the batch or state in a record) gets the key's prefix from here in ARGV
and appends the id; for every such prefix, `prefix + id` is exactly the name its entry builds.

Lifetimes: job-scoped keys (record, events, webhooks, idempotency entry) get `retention_s` when the
job reaches a terminal state and have no TTL while it is live; the lease key lives `lease_ttl_s`;
a node key lives its heartbeat TTL; index entries of expired records are skipped when read and
removed by `JobStore.prune_indexes` (from the `retired` set) or lazily by `list_jobs`.
"""

from __future__ import annotations

import re

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,127}")


def valid_id(value: str) -> bool:
    """True if `value` may be a job or batch id (safe inside keys and object paths)."""
    return bool(_ID.fullmatch(value))


# The shortest id prefix a user may type for a job or batch (storage/id_prefix.py looks them up):
# shorter ones would match too much to be useful. Here, beside the id's form, so a command line
# talking to a remote API shows it without loading the Redis client.
MIN_ID_PREFIX = 6


_QUEUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def valid_queue(value: str) -> bool:
    """True if `value` may name a queue inside a key (`<lane>.<pipeline>`: no `:`, no spaces)."""
    return bool(_QUEUE.fullmatch(value))


# a job's record key + these are its lease, its stop request and its webhook attempts (the
# reaper's script completes them for the jobs it finds: storage/lua/reap_lapsed.lua)
LEASE_SUFFIX, STOP_SUFFIX, WEBHOOKS_SUFFIX = ":lease", ":cancel", ":webhooks"


class Keys:
    """Key names of one namespace."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    # --- per job -------------------------------------------------------------------------------
    @property
    def job_prefix(self) -> str:
        """Prefix of job records (scripts complete it with an id read from a set or an entry)."""
        return f"{self.ns}:job:"

    def job(self, job_id: str) -> str:
        """Hash: the job record."""
        return self.job_prefix + job_id

    @property
    def events_suffix(self) -> str:
        """A job's record key + this suffix is its events key (create_many completes both)."""
        return ":events"

    def events(self, job_id: str) -> str:
        """Stream of the job's events; entry ids are `<seq>-0`."""
        return self.job(job_id) + self.events_suffix

    def lease(self, job_id: str) -> str:
        """String `<token>|<owner>` with the lease TTL."""
        return self.job(job_id) + LEASE_SUFFIX

    def cancel(self, job_id: str) -> str:
        """The running job's stop request while one is pending: a cancel, a pause or a preemption.

        (Named when it held cancels only; storage/leases.py `StopRequest` reads its values.)
        """
        return self.job(job_id) + STOP_SUFFIX

    def preempt_claim(self, job_id: str) -> str:
        """Set while a preemption made room for this waiting job: one per job at a time."""
        return self.job(job_id) + ":preempt_for"

    def webhooks(self, job_id: str) -> str:
        """List of webhook delivery attempts (JSON)."""
        return self.job(job_id) + WEBHOOKS_SUFFIX

    # --- per idempotency key, batch, state, owner ----------------------------------------------
    @property
    def idempotency_prefix(self) -> str:
        """Prefix of idempotency entries (scripts complete it with the key a record names)."""
        return f"{self.ns}:idem:"

    def idempotency(self, key: str) -> str:
        """Hash per idempotency key: job_id, fingerprint."""
        return self.idempotency_prefix + key

    @property
    def batch_prefix(self) -> str:
        """Prefix of batch records (scripts complete it with the batch id a record names)."""
        return f"{self.ns}:batch:"

    def batch(self, batch_id: str) -> str:
        """Hash per fed batch: status, cursor, options, `n_<state>` job counters (batch_records)."""
        return self.batch_prefix + batch_id

    @property
    def state_index_prefix(self) -> str:
        """Prefix of the state indexes (scripts complete it with the state a record holds)."""
        return f"{self.ns}:idx:state:"

    def state_index(self, state: str) -> str:
        """Sorted set per state of job ids, scored by creation sequence."""
        return self.state_index_prefix + state

    @property
    def batch_index_prefix(self) -> str:
        """Prefix of the batch indexes (scripts complete it with the batch id a record names)."""
        return f"{self.ns}:idx:batch:"

    def batch_index(self, batch_id: str) -> str:
        """Sorted set per batch of job ids, scored by creation sequence."""
        return self.batch_index_prefix + batch_id

    @property
    def owner_index_prefix(self) -> str:
        """Prefix of the owner indexes (prune_indexes completes it with a retired job's owner)."""
        return f"{self.ns}:idx:owner:"

    def owner_index(self, owner: str) -> str:
        """Sorted set per owner of job ids, scored by creation sequence."""
        return self.owner_index_prefix + owner

    @property
    def queue_index_prefix(self) -> str:
        """Prefix of the queue indexes (scripts complete it with the queue a record names)."""
        return f"{self.ns}:idx:queue:"

    def queue_index(self, queue: str) -> str:
        """Sorted set per queue (`<lane>.<pipeline>`) of its queued job ids, in queue order.

        Scored by the creation sequence drawn when the job entered `queued` (at creation, and again
        on each return to the queue), so ZRANK is the number of queued jobs ahead of it.
        """
        return self.queue_index_prefix + queue

    def queue_server(self, queue: str) -> str:
        """The run_id of the Redis server a consumer of `queue` last saw (restart detection)."""
        return f"{self.ns}:queue_server:{queue}"

    @property
    def completions_prefix(self) -> str:
        """Prefix of the completion windows (scripts complete it with the queue a record names)."""
        return f"{self.ns}:completions:"

    def completions(self, queue: str) -> str:
        """Sorted set per queue of recently finished runs: `<job id>@<start ms>` -> finish (ms).

        Trimmed to a time window and a size cap by the transition that ends a run; it expires when
        no run of the queue has finished for a window. Read for the queue's completion rate.
        """
        return self.completions_prefix + queue

    @property
    def usage_prefix(self) -> str:
        """Prefix of the hourly usage buckets (scripts complete it with the hour they write)."""
        return f"{self.ns}:usage:"

    def usage(self, hour: str) -> str:
        """Hash per hour (its start, epoch seconds): the ledger's usage (storage/usage.py).

        GPU-seconds, joules and attempts per owner and pipeline, and nodes' held and busy
        GPU-seconds; it expires USAGE_RETENTION_S after its last write (kiln/common/ledger.py).
        """
        return self.usage_prefix + hour

    # --- dead letters (storage/dead_letters.py) -------------------------------------------------
    @property
    def dead_letter_prefix(self) -> str:
        """Prefix of dead-letter records (the cap's trim completes it with ids from the index)."""
        return f"{self.ns}:dead:job:"

    def dead_letter(self, job_id: str) -> str:
        """Hash: a failed job's dead letter (request, attempts, error); its own retention."""
        return self.dead_letter_prefix + job_id

    @property
    def dead_letter_index(self) -> str:
        """Sorted set of dead-letter job ids, scored by a creation-sequence number."""
        return f"{self.ns}:dead:idx:all"

    @property
    def dead_letter_owner_prefix(self) -> str:
        """Prefix of the per-owner dead-letter indexes (completed with the owner a record names)."""
        return f"{self.ns}:dead:idx:owner:"

    def dead_letter_owner_index(self, owner: str) -> str:
        """Sorted set per owner of its dead-letter job ids, scored as the dead-letter index."""
        return self.dead_letter_owner_prefix + owner

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
        """Counter giving each job a unique creation sequence (index score).

        A job that returns to `queued` draws a new number from it for its queue index score.
        """
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
    def owner_queued(self) -> str:
        """Hash: owner (API key id) -> its jobs in `queued`; an owner at 0 has no field."""
        return f"{self.ns}:owner_queued"

    @property
    def owner_running(self) -> str:
        """Hash: owner (API key id) -> its jobs in `running`; an owner at 0 has no field."""
        return f"{self.ns}:owner_running"

    @property
    def finished_counts(self) -> str:
        """Hash of monotonic counters of terminal transitions; no TTL (storage/counters.py).

        `job/<queue>/<state>`: jobs of a queue (`<lane>.<pipeline>`, '' for a job without one)
        that reached a terminal state; `line/<state>`: those of them that were batch lines;
        `batch/<status>`: fed batches that ended with that final status. Each adds 1 in the step
        that ends its job or batch (which never ends twice), so the counts outlive the records.
        """
        return f"{self.ns}:counters:finished"

    def upload_slot(self, owner: str, upload_id: str) -> str:
        """String (JSON: declared size, content type) of an upload slot the API issued.

        For the API's own PUT (a local store); its TTL is the slot's expiry
        (storage/uploaded_inputs.py).
        """
        return f"{self.ns}:upload:{owner}:{upload_id}"

    # --- operator controls -----------------------------------------------------------------------
    @property
    def paused_queues(self) -> str:
        """Hash: queue (`<lane>.<pipeline>`) -> when and by whom it was paused (JSON); no TTL."""
        return f"{self.ns}:paused_queues"

    def shared_view(self, name: str) -> str:
        """String: a view of the cluster one node computed for all (JSON), with a TTL."""
        return f"{self.ns}:views:{name}"

    def shared_view_claim(self, name: str) -> str:
        """String: which node computes the view `name` now; its TTL is the view's interval."""
        return f"{self.ns}:views:{name}:claim"

    @property
    def drain_requests(self) -> str:
        """Hash: node id -> the operator's drain request for it (JSON); no TTL."""
        return f"{self.ns}:drain_requests"

    # --- batches fed from the object store (storage/batch_store.py) ----------------------------
    # The batch record itself is `batch(batch_id)`; a fed batch adds its own fields to it
    # (status, cursor, counts of lines ended unfed, ...). These keys expire with it at the end.
    def batch_feeder(self, batch_id: str) -> str:
        """String `<token>|<owner>` with the lease TTL: the one feeder of the batch."""
        return self.batch(batch_id) + ":feeder"

    def batch_open(self, batch_id: str) -> str:
        """Sorted set of the batch's fed jobs whose result is not written yet, scored by line."""
        return self.batch(batch_id) + ":open"

    def batch_parts(self, batch_id: str) -> str:
        """List of the object keys of the batch's committed result parts, in order."""
        return self.batch(batch_id) + ":parts"

    @property
    def active_batches(self) -> str:
        """Sorted set of batch ids still being fed or finished, scored by batch sequence."""
        return f"{self.ns}:batches:active"

    @property
    def batch_list(self) -> str:
        """Sorted set of every fed batch's id, scored by batch sequence (newest last)."""
        return f"{self.ns}:batches:all"

    def batch_owner_list(self, owner: str) -> str:
        """Sorted set per owner (API key id) of its batch ids, scored by batch sequence."""
        return f"{self.ns}:batches:owner:{owner}"

    @property
    def batch_seq(self) -> str:
        """Counter giving each fed batch a unique sequence number (index score)."""
        return f"{self.ns}:batches:seq"

    # --- nodes ---------------------------------------------------------------------------------
    @property
    def node_prefix(self) -> str:
        """Prefix of node heartbeats (live_nodes completes it with the ids in `nodes`)."""
        return f"{self.ns}:node:"

    def node(self, node_id: str) -> str:
        """A node's heartbeat (JSON) with its TTL."""
        return self.node_prefix + node_id

    @property
    def nodes(self) -> str:
        """Sorted set of node ids scored by heartbeat deadline (ms)."""
        return f"{self.ns}:nodes"

    @property
    def held_deliveries(self) -> str:
        """Hash: node id -> "deadline_ms/written_ms/incarnation job_id ..."; no TTL.

        The node's heartbeat deadline, its last write and its process token, then the jobs whose
        messages it holds; an earlier process's entry under the same id sits at `<id>~<token>`
        until claimed (storage/lua/_held.lua).
        """
        return f"{self.ns}:nodes:held"

    @property
    def held_deadlines(self) -> str:
        """Sorted set: each entry of `held_deliveries` -> its deadline (ms), to find lapses."""
        return f"{self.ns}:nodes:held_deadlines"

    @property
    def queued_audits(self) -> str:
        """Hash: queue -> when a node last claimed its audit of lost messages (Redis ms)."""
        return f"{self.ns}:nodes:audits"

    @property
    def last_lapse(self) -> str:
        """Hash: `claimed_ms` and `deadline_ms` of the latest claimed node lapse (Redis ms).

        Written by held_claim, read by audit_claim: a lapse makes every queue's audit due at once.
        """
        return f"{self.ns}:nodes:lapse"

    # --- API keys ------------------------------------------------------------------------------
    @property
    def api_key_prefix(self) -> str:
        """Prefix of API key records (apikey_revoke completes it with the hash an id maps to)."""
        return f"{self.ns}:apikey:"

    def api_key(self, key_hash: str) -> str:
        """Hash: one API key record, found by the hash of the secret."""
        return self.api_key_prefix + key_hash

    def api_key_id(self, key_id: str) -> str:
        """String: key id → key hash."""
        return f"{self.ns}:apikey_id:{key_id}"

    @property
    def api_key_ids(self) -> str:
        """Set of every API key id."""
        return f"{self.ns}:apikeys"
