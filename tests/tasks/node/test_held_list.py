"""A node's held list (tasks/node/held.py): noted by the consumer, written by the node's loop.

The Celery consumer calls `received` for every message it hands on: it must not wait on Redis.
The node's `held` loop writes the list once something arrived; a heartbeat writes it always.
"""

from __future__ import annotations

import time

from kiln.storage.job_store import JobStore
from kiln.tasks.node.held import HeldDeliveries


def lapsed_list(store: JobStore) -> list[str]:
    """The list the node wrote last, as a sweeper claims it once the node lapsed."""
    time.sleep(0.1)  # the entry's 50 ms life, over
    return sorted(j for holder in store.claim_lapsed_holders().holders for j in holder.job_ids)


def listed_by(store: JobStore, node_id: str) -> tuple[HeldDeliveries, list[list[str]]]:
    """A node's held list writing to `store` (50 ms entries), and the lists it has sent."""
    held = HeldDeliveries()
    sent: list[list[str]] = []

    def record(job_ids: list[str]) -> None:
        sent.append(job_ids)
        store.record_held(node_id, job_ids, 0.05, held.incarnation)

    held.publish_with(record)
    return held, sent


def test_a_message_is_listed_by_the_held_loop_not_by_the_consumer(job_store: JobStore) -> None:
    held, sent = listed_by(job_store, "node-a")
    held.received("task-1", "job-1")
    held.received("task-2", "job-2")
    assert sent == []  # the consumer's calls wrote nothing
    held.write_if_changed()  # the loop's tick: both, in one write
    held.write_if_changed()  # nothing arrived since: no write
    assert sent == [["job-1", "job-2"]]
    assert lapsed_list(job_store) == ["job-1", "job-2"]


def test_a_finished_message_leaves_with_the_next_write(job_store: JobStore) -> None:
    held, sent = listed_by(job_store, "node-b")
    held.received("task-1", "job-1")
    held.received("task-2", "job-2")
    held.write_if_changed()
    held.finished("task-1")
    held.write_if_changed()  # a finish alone is not urgent (a listed finished job is harmless)
    assert sent == [["job-1", "job-2"]]
    held.write()  # the heartbeat's: it drops it
    assert sent[-1] == ["job-2"]
    assert lapsed_list(job_store) == ["job-2"]
