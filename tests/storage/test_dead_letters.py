"""Dead letters: the failing transition records each failed job once, with every attempt, capped."""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.storage.checkpoints import record_checkpoint
from kiln.storage.dead_letters import DeadLetterStore
from kiln.storage.job_store import JobStore
from kiln.storage.settings import StorageSettings
from tests.storage.helpers import WORKER, job_in_state, new_job

RETRYABLE = {"type": "WorkerGroupDied", "message": "the worker group died", "retryable": True}
FINAL = {"type": "WorkerGroupDied", "message": "the worker group died again", "retryable": False}


def dead_letters(store: JobStore) -> DeadLetterStore:
    return DeadLetterStore(store.redis, store.settings)


def run_once(store: JobStore, job_id: str, node: str) -> int:
    token = store.acquire_lease(job_id, WORKER)
    store.start(job_id, token, node_id=node)
    return token


def test_a_failed_job_is_recorded_with_its_request_and_every_attempt(job_store: JobStore) -> None:
    record, _ = job_store.create_job(
        new_job(request={"prompt": "x", "pipeline": "tiny"}, owner="key-a", metadata={"m": "1"})
    )
    job_id = record.id
    token = run_once(job_store, job_id, "node-1")
    job_store.requeue(job_id, token, RETRYABLE)
    token = run_once(job_store, job_id, "node-2")
    failed = job_store.fail(job_id, token, FINAL)
    letter = dead_letters(job_store).get(job_id)
    assert letter is not None
    assert letter.request == {"prompt": "x", "pipeline": "tiny"}
    assert (letter.owner, letter.metadata, letter.attempts) == ("key-a", {"m": "1"}, 2)
    assert letter.error == FINAL
    assert letter.checkpoint is None
    assert letter.redriven_to is None
    assert letter.dead_at == failed.finished_at
    first, second = letter.attempt_log
    assert (first["attempt"], first["node"], first["outcome"]) == (1, "node-1", "queued")
    assert first["error"] == RETRYABLE
    assert (second["attempt"], second["node"], second["outcome"]) == (2, "node-2", "failed")
    assert second["error"] == FINAL
    assert first["started_at"] <= first["ended_at"] <= second["started_at"] <= second["ended_at"]


def test_only_failed_jobs_are_recorded(job_store: JobStore) -> None:
    ids = {state: job_in_state(job_store, state)[0] for state in JobState}
    store = dead_letters(job_store)
    assert [state for state, job_id in ids.items() if store.get(job_id)] == [JobState.FAILED]
    assert store.count() == 1


def test_a_failed_queued_job_is_recorded_with_no_attempt(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.FAILED)
    letter = dead_letters(job_store).get(job_id)
    assert letter is not None
    assert (letter.attempts, letter.attempt_log, letter.error_type) == (0, [], "Boom")


def test_listing_is_owner_scoped_and_paged_newest_first(job_store: JobStore) -> None:
    mine = [job_in_state(job_store, JobState.FAILED, owner="key-a")[0] for _ in range(5)]
    theirs = job_in_state(job_store, JobState.FAILED, owner="key-b")[0]
    store = dead_letters(job_store)
    first, cursor = store.page("key-a", None, 3)
    assert cursor is not None
    rest, end = store.page("key-a", cursor, 3)
    assert end is None
    assert [d.id for d in first + rest] == mine[::-1]
    every, _ = store.page(None, None, 10)
    assert [d.id for d in every] == [theirs, *mine[::-1]]


@pytest.mark.slow  # 10,000 real failures: about 12 s
def test_the_set_stays_within_its_cap_under_10000_failures(
    storage_settings: StorageSettings,
) -> None:
    cap = 100
    store = JobStore.from_settings(storage_settings.model_copy(update={"dead_letter_max": cap}))
    letters = dead_letters(store)
    failed: list[str] = []
    error = {"type": "Boom", "message": "boom", "retryable": False}
    for chunk in range(100):
        news = [new_job(owner=f"key-{chunk % 3}") for _ in range(100)]
        store.create_jobs(news)
        for new in news:
            store.fail(new.id, None, error)
            failed.append(new.id)
        assert letters.count() <= cap
    assert len(failed) == 10_000
    assert letters.count() == cap
    kept, _ = letters.page(None, None, cap)
    assert [d.id for d in kept] == failed[::-1][:cap]
    # the dropped ones are gone, records and owner index entries with them
    assert letters.get(failed[0]) is None
    owned = sum(letters.count(f"key-{n}") for n in range(3))
    assert owned == cap


def test_a_dead_letter_is_claimed_for_one_redrive(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.FAILED)
    store = dead_letters(job_store)
    assert store.claim(job_id, "new-1")
    assert not store.claim(job_id, "new-2")
    letter = store.get(job_id)
    assert letter is not None
    assert letter.redriven_to == "new-1"
    store.unclaim(job_id, "new-1")
    assert store.claim(job_id, "new-3")
    assert not store.claim("never-failed", "new-4")
    assert store.get("never-failed") is None


def test_a_lapsed_lease_and_a_cancel_close_their_attempts_with_the_reason(
    job_store: JobStore,
) -> None:
    record, _ = job_store.create_job(new_job())
    job_id = record.id
    run_once(job_store, job_id, "node-1")
    job_store.redis.delete(job_store.keys.lease(job_id))  # its node died: the lease lapsed
    assert job_store.reap(job_id)
    token = run_once(job_store, job_id, "node-2")
    job_store.cancel(job_id)
    job_store.finish_canceled(job_id, token)
    log = DeadLetterStore(job_store.redis, job_store.settings).attempt_log(job_id)
    assert [(a["node"], a["outcome"], a["error"]) for a in log] == [
        ("node-1", "queued", {"type": "lease_expired"}),
        ("node-2", "canceled", {"type": "requested"}),
    ]
    assert dead_letters(job_store).get(job_id) is None  # canceled: no dead letter


def test_a_dead_letter_lives_its_own_retention_and_goes_from_the_lists_after(
    storage_settings: StorageSettings,
) -> None:
    settings = storage_settings.model_copy(
        update={"dead_letter_retention_s": 5000, "retention_s": 60}
    )
    store = JobStore.from_settings(settings)
    letters = dead_letters(store)
    kept, gone = (job_in_state(store, JobState.FAILED, owner="key-a")[0] for _ in range(2))
    assert 4990 < store.redis.ttl(store.keys.dead_letter(kept)) <= 5000
    assert store.redis.ttl(store.keys.job(kept)) <= 60  # the job record keeps its own
    store.redis.delete(store.keys.dead_letter(gone))  # as its retention ends
    for owner in (None, "key-a"):
        page, _ = letters.page(owner, None, 10)
        assert [d.id for d in page] == [kept]
        assert letters.count(owner) == 1  # the listing dropped the expired one's entry


def test_a_dead_letter_holds_the_jobs_last_checkpoint(job_store: JobStore) -> None:
    record, _ = job_store.create_job(new_job())
    job_id = record.id
    token = run_once(job_store, job_id, "node-1")
    for steps in (10, 20):
        entry = {"key": f"ckpt/{steps}", "sha256": "0" * 64, "size": 5, "steps_done": steps,
                 "lease_token": token, "attempt": "a1"}  # fmt: skip
        written_at, _ = record_checkpoint(job_store, job_id, token, entry)
    job_store.fail(job_id, token, FINAL)
    letter = dead_letters(job_store).get(job_id)
    assert letter is not None
    assert letter.checkpoint == {**entry, "written_at": written_at}


def test_a_damaged_checkpoint_record_still_fails_the_job_its_letter_says_none(
    job_store: JobStore,
) -> None:
    record, _ = job_store.create_job(new_job())
    token = run_once(job_store, record.id, "node-1")
    job_store.redis.hset(job_store.keys.job(record.id), "checkpoints", "{not json")
    assert job_store.fail(record.id, token, FINAL).state == JobState.FAILED
    letter = dead_letters(job_store).get(record.id)
    assert letter is not None
    assert letter.checkpoint is None
