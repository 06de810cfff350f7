"""Helpers for storage tests: new jobs, and jobs brought into a given state the legal way."""

from __future__ import annotations

import secrets
from typing import Any

from kiln.common.states import JobState
from kiln.storage.batch_store import BatchFeeding
from kiln.storage.job_store import JobRecord, JobStore, NewJob

WORKER = "worker-a"


def new_job(**overrides: Any) -> NewJob:
    """A NewJob with a fresh id and a small request."""
    fields: dict[str, Any] = {"id": "job-" + secrets.token_hex(6), "request": {"prompt": "a cat"}}
    fields.update(overrides)
    return NewJob(**fields)


def lease_token(store: JobStore, job_id: str) -> int:
    """The token the record holds (0: none), as the fenced scripts read it."""
    return int(store.redis.hget(store.keys.job(job_id), "lease_token") or 0)


def job_in_state(store: JobStore, state: JobState, **overrides: Any) -> tuple[str, int]:
    """Create a job and drive it into `state`; returns (job_id, the last lease token or 0)."""
    record, _ = store.create_job(new_job(**overrides))
    job_id, token = record.id, 0
    if state in (JobState.RUNNING, JobState.SUCCEEDED):
        token = store.acquire_lease(job_id, WORKER)
        store.start(job_id, token)
    if state == JobState.SUCCEEDED:
        store.succeed(job_id, token, [{"key": "k"}], {"run_s": 0.1})
    elif state == JobState.FAILED:
        store.fail(job_id, None, {"type": "Boom", "message": "boom", "retryable": False})
    elif state == JobState.CANCELED:
        store.cancel(job_id)
    elif state == JobState.EXPIRED:
        store.expire(job_id)
    elif state == JobState.PAUSED:
        store.pause(job_id)
    assert store.get(job_id).state == state
    return job_id, token


def perform(store: JobStore, job_id: str, token: int, target: JobState) -> JobRecord:
    """Ask for the transition into `target` through the store's public operation for it."""
    state = store.get(job_id).state
    if target == JobState.RUNNING:
        return store.start(job_id, token)
    if target == JobState.SUCCEEDED:
        return store.succeed(job_id, token, [{"key": "k"}], {"run_s": 1.0})
    if target == JobState.FAILED:
        return store.fail(job_id, token, {"type": "Boom", "message": "boom", "retryable": False})
    if target == JobState.PAUSED:
        return (
            store.pause(job_id) if state == JobState.QUEUED else store.pause_stopped(job_id, token)
        )
    if state == JobState.PAUSED:  # its own operations: resume, expire_paused, cancel
        return _perform_paused(store, job_id, target)
    if target == JobState.QUEUED:
        return store.requeue(job_id, token, {"type": "Flaky", "message": "x", "retryable": True})
    if target == JobState.EXPIRED:
        return store.expire(job_id)
    if state == JobState.QUEUED:
        return store.cancel(job_id)
    return store.finish_canceled(job_id, token)


def _perform_paused(store: JobStore, job_id: str, target: JobState) -> JobRecord:
    """A paused job's way into queued, expired or canceled: resume, expire_paused, cancel."""
    if target == JobState.QUEUED:
        return store.resume(job_id)
    if target == JobState.EXPIRED:
        return store.expire_paused(job_id)
    return store.cancel(job_id)


def event_types(store: JobStore, job_id: str) -> list[str]:
    """Types of the job's events, checking seq is 1..n without gaps."""
    events = store.events(job_id, count=10_000)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    return [e.type for e in events]


def feeder_of(feeding: BatchFeeding, batch_id: str) -> str | None:
    """Owner of the batch's live feeder lease (`<token>|<owner>`, storage/keys.py), or None."""
    held: str | None = feeding.redis.get(feeding.keys.batch_feeder(batch_id))
    return held.split("|", 1)[1] if held else None


def lapse_lease(store: JobStore, job_id: str) -> None:
    """What a dead node leaves: no lease, its deadline passed."""
    store.redis.delete(store.keys.lease(job_id))
    store.redis.zadd(store.keys.running, {job_id: 0})
