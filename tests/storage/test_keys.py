"""Key names: stable (stored data outlives a release), and every prefix completes into its entry."""

from __future__ import annotations

import inspect

from kiln.storage.keys import Keys

# what each entry of Keys builds for the namespace "ns" and the id "x"; a change here orphans the
# data of every running deployment
NAMES = {
    "job": "ns:job:x",
    "events": "ns:job:x:events",
    "lease": "ns:job:x:lease",
    "cancel": "ns:job:x:cancel",
    "preempt_claim": "ns:job:x:preempt_for",
    "webhooks": "ns:job:x:webhooks",
    "idempotency": "ns:idem:x",
    "batch": "ns:batch:x",
    "state_index": "ns:idx:state:x",
    "batch_index": "ns:idx:batch:x",
    "owner_index": "ns:idx:owner:x",
    "queue_index": "ns:idx:queue:x",
    "queue_server": "ns:queue_server:x",
    "completions": "ns:completions:x",
    "all_index": "ns:idx:all",
    "retired": "ns:retired",
    "creation_seq": "ns:creation_seq",
    "running": "ns:running",
    "unpublished": "ns:unpublished",
    "queue_depth": "ns:queue_depth",
    "owner_queued": "ns:owner_queued",
    "owner_running": "ns:owner_running",
    "finished_counts": "ns:counters:finished",
    "upload_slot": "ns:upload:x:x",
    "paused_queues": "ns:paused_queues",
    "drain_requests": "ns:drain_requests",
    "shared_view": "ns:views:x",
    "shared_view_claim": "ns:views:x:claim",
    "node": "ns:node:x",
    "nodes": "ns:nodes",
    "held_deliveries": "ns:nodes:held",
    "held_deadlines": "ns:nodes:held_deadlines",
    "queued_audits": "ns:nodes:audits",
    "last_lapse": "ns:nodes:lapse",
    "api_key": "ns:apikey:x",
    "api_key_id": "ns:apikey_id:x",
    "api_key_ids": "ns:apikeys",
    "batch_feeder": "ns:batch:x:feeder",
    "batch_open": "ns:batch:x:open",
    "batch_parts": "ns:batch:x:parts",
    "active_batches": "ns:batches:active",
    "batch_list": "ns:batches:all",
    "batch_owner_list": "ns:batches:owner:x",
    "batch_seq": "ns:batches:seq",
    "dead_letter": "ns:dead:job:x",
    "dead_letter_index": "ns:dead:idx:all",
    "dead_letter_owner_index": "ns:dead:idx:owner:x",
    "usage": "ns:usage:x",
}
# the prefixes scripts complete with an id they read, and the entry each must agree with
PREFIXES = {
    "job_prefix": "job",
    "idempotency_prefix": "idempotency",
    "batch_prefix": "batch",
    "state_index_prefix": "state_index",
    "batch_index_prefix": "batch_index",
    "owner_index_prefix": "owner_index",
    "queue_index_prefix": "queue_index",
    "completions_prefix": "completions",
    "usage_prefix": "usage",
    "node_prefix": "node",
    "api_key_prefix": "api_key",
    "dead_letter_prefix": "dead_letter",
    "dead_letter_owner_prefix": "dead_letter_owner_index",
}


def _entries() -> dict[str, str]:
    keys = Keys("ns")
    built = {}
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_") or name in PREFIXES or name == "events_suffix":
            continue
        if isinstance(member, property):
            built[name] = getattr(keys, name)
        elif inspect.isfunction(member):
            takes = len(inspect.signature(member).parameters) - 1  # self
            built[name] = getattr(keys, name)(*["x"] * takes)
    return built


def test_every_key_name_is_as_stored() -> None:
    assert _entries() == NAMES


def test_prefixes_complete_into_their_entries() -> None:
    keys = Keys("ns")
    for prefix, entry in PREFIXES.items():
        assert getattr(keys, prefix) + "x" == getattr(keys, entry)("x"), prefix
    assert keys.job("x") + keys.events_suffix == keys.events("x")
