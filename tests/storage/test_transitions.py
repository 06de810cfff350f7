"""The state machine: every allowed and every forbidden transition, fencing, races."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kiln.common.states import TERMINAL_STATES, TRANSITIONS, JobState
from kiln.storage.errors import IllegalTransition, StaleLease, StorageError
from kiln.storage.job_store import JobStore
from tests.storage.helpers import WORKER, event_types, job_in_state, perform

PAIRS = list(itertools.product(JobState, JobState))
pytestmark = pytest.mark.every_redis  # refusals are script errors: 6.2 must pass them on too


def test_table_shape() -> None:
    assert set(TERMINAL_STATES) == {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELED,
        JobState.EXPIRED,
    }
    assert all(not TRANSITIONS[s] for s in TERMINAL_STATES)


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_transition_matrix(job_store: JobStore, source: JobState, target: JobState) -> None:
    job_id, _ = job_in_state(job_store, source)
    token = job_store.acquire_lease(job_id, WORKER)  # a current token: only the state decides
    before = job_store.get(job_id)
    events_before = event_types(job_store, job_id)
    if target in TRANSITIONS[source]:
        record = perform(job_store, job_id, token, target)
        assert record.state == target
        assert job_store.get(job_id).state == target
        # a resume (paused -> queued) says so: its event is `resumed`
        resumed = source == JobState.PAUSED and target == JobState.QUEUED
        expected = "resumed" if resumed else target.value
        assert event_types(job_store, job_id) == [*events_before, expected]
    else:
        with pytest.raises(IllegalTransition):
            perform(job_store, job_id, token, target)
        assert job_store.get(job_id) == before
        assert event_types(job_store, job_id) == events_before


def test_start_counts_attempts_and_sets_times(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    record = job_store.requeue(job_id, token, {"type": "Flaky", "message": "x", "retryable": True})
    assert record.state == JobState.QUEUED
    assert record.attempts == 1
    assert record.error == {"type": "Flaky", "message": "x", "retryable": True}
    token = job_store.acquire_lease(job_id, WORKER)
    record = job_store.start(job_id, token)
    assert record.attempts == 2
    assert record.started_at is not None
    done = job_store.succeed(job_id, token, [{"key": "a/0.png"}], {"run_s": 2.0})
    assert done.finished_at is not None
    assert done.finished_at >= record.created_at
    assert done.outputs == [{"key": "a/0.png"}]
    assert done.metrics == {"run_s": 2.0}
    assert done.error is None


FENCED: dict[str, Callable[[JobStore, str, int], Any]] = {
    "succeed": lambda s, j, t: s.succeed(j, t, [], {}),
    "fail": lambda s, j, t: s.fail(j, t, {"type": "x"}),
    "requeue": lambda s, j, t: s.requeue(j, t, {"type": "x"}),
    "finish_canceled": lambda s, j, t: s.finish_canceled(j, t),
    "set_progress": lambda s, j, t: s.set_progress(j, t, {"step": 1}),
}


@pytest.mark.parametrize("operation", sorted(FENCED))
def test_stale_token_refused(job_store: JobStore, operation: str) -> None:
    job_id, old = job_in_state(job_store, JobState.RUNNING)
    job_store.release_lease(job_id, old)
    new = job_store.acquire_lease(job_id, "worker-b")
    assert new > old
    with pytest.raises(StaleLease):
        FENCED[operation](job_store, job_id, old)
    assert job_store.get(job_id).state == JobState.RUNNING
    FENCED[operation](job_store, job_id, new)  # the current holder still can


def test_start_with_stale_token_refused(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    old = job_store.acquire_lease(job_id, WORKER)
    job_store.acquire_lease(job_id, WORKER)  # the same owner re-acquiring fences its old token
    with pytest.raises(StaleLease):
        job_store.start(job_id, old)


def test_fail_running_without_token_refused(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.RUNNING)
    with pytest.raises(StaleLease):
        job_store.fail(job_id, None, {"type": "x"})


def test_cancel_queued_running_terminal(job_store: JobStore) -> None:
    queued, _ = job_in_state(job_store, JobState.QUEUED)
    assert job_store.cancel(queued).state == JobState.CANCELED
    running, token = job_in_state(job_store, JobState.RUNNING)
    assert not job_store.cancel_requested(running)
    record = job_store.cancel(running)
    assert record.state == JobState.RUNNING
    assert job_store.cancel_requested(running)
    assert job_store.finish_canceled(running, token).state == JobState.CANCELED
    assert not job_store.cancel_requested(running)
    done, _ = job_in_state(job_store, JobState.SUCCEEDED)
    before = job_store.get(done)
    assert job_store.cancel(done) == before


def test_pending_cancel_wins_over_requeue(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    job_store.cancel(job_id)
    record = job_store.requeue(job_id, token, {"type": "Flaky"})
    assert record.state == JobState.CANCELED
    assert event_types(job_store, job_id)[-1] == "canceled"


def _race(workers: int, attempt: Callable[[int], Any]) -> list[Any]:
    """Run attempt(i) on `workers` threads released at once; returns results or exceptions."""
    barrier = threading.Barrier(workers)
    results: list[Any] = [None] * workers

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = attempt(i)
        except StorageError as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_concurrent_terminal_transitions_one_wins(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    operations = ["succeed", "fail", "requeue", "finish_canceled"]
    results = _race(16, lambda i: FENCED[operations[i % 4]](job_store, job_id, token))
    winners = [r for r in results if not isinstance(r, StorageError)]
    assert len(winners) == 1
    assert all(isinstance(r, IllegalTransition | StaleLease) for r in results if r not in winners)
    types = event_types(job_store, job_id)
    assert types[:2] == ["queued", "running"]
    assert len(types) == 3


def test_concurrent_unfenced_transitions_one_wins(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)

    def attempt(i: int) -> Any:
        if i % 2:
            return job_store.expire(job_id)
        return job_store.fail(job_id, None, {"type": "x"})

    results = _race(16, attempt)
    assert sum(not isinstance(r, StorageError) for r in results) == 1
    assert len(event_types(job_store, job_id)) == 2
    assert job_store.queue_depth() == 0


def test_concurrent_acquire_one_owner_wins(job_store: JobStore) -> None:
    job_id, _ = job_in_state(job_store, JobState.QUEUED)
    results = _race(16, lambda i: job_store.acquire_lease(job_id, f"worker-{i}"))
    tokens = [r for r in results if isinstance(r, int)]
    assert len(tokens) == 1
    winner = results.index(tokens[0])
    assert job_store.lease_owner(job_id) == f"worker-{winner}"
