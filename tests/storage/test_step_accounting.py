"""Step accounting: the transition that closes an attempt writes its steps and the job's sums.

Every figure here is the arithmetic of kiln/common/accounting.py run by its one writer
(storage/lua/_machine.lua) on a real Redis: an attempt's own report (a node that ends it), or what
the record says of an attempt whose node died (its progress, its own checkpoints).
"""

from __future__ import annotations

import json
from typing import Any

from kiln.common.accounting import AttemptSteps, StepAccounting
from kiln.common.states import JobState
from kiln.storage.checkpoints import record_checkpoint
from kiln.storage.counters import finished_counts
from kiln.storage.dead_letters import DeadLetterStore
from kiln.storage.job_store import JobStore
from tests.storage.helpers import WORKER, lapse_lease, new_job

QUEUE = "interactive.tiny"
HANDED_BACK = {"type": "handed_back", "message": "the node shut down", "retryable": True}


def run(store: JobStore, job_id: str) -> int:
    token = store.acquire_lease(job_id, WORKER)
    store.start(job_id, token, node_id="node-1")
    return token


def denoised(store: JobStore, job_id: str, token: int, step: int, total: int = 50) -> None:
    store.set_progress(job_id, token, {"stage": "denoising", "step": step, "total": total})


def checkpoint(store: JobStore, job_id: str, token: int, steps_done: int) -> None:
    entry: dict[str, object] = {
        "key": f"ckpt/{job_id}/{token}/{steps_done}",
        "sha256": "0" * 64,
        "size": 1,
        "steps_done": steps_done,
        "lease_token": token,
        "attempt": f"{token}-x",
    }
    record_checkpoint(store, job_id, token, entry)


def _log(store: JobStore, job_id: str) -> list[dict[str, Any]]:
    return list(json.loads(store.redis.hget(store.keys.job(job_id), "attempt_log") or "[]"))


def test_a_dead_node_is_read_from_its_progress_and_checkpoints_and_the_resume_from_its_report(
    job_store: JobStore,
) -> None:
    job_id = job_store.create_job(new_job(queue=QUEUE))[0].id
    before = finished_counts(job_store).steps
    token = run(job_store, job_id)
    denoised(job_store, job_id, token, 20)
    checkpoint(job_store, job_id, token, 24)  # newer than its last progress written
    lapse_lease(job_store, job_id)  # the node dies past step 24
    assert job_store.reap(job_id)
    first = _log(job_store, job_id)[0]
    assert (first["steps_restored"], first["steps_reached"], first["steps_computed"]) == (0, 24, 24)
    assert first["steps_recomputed"] == 0
    token = run(job_store, job_id)
    assert _log(job_store, job_id)[1]["steps_restored"] == 24  # offered the newest checkpoint
    denoised(job_store, job_id, token, 30)
    record = job_store.succeed(
        job_id, token, [], {}, steps=AttemptSteps(restored=20, reached=50, step_s=0.5)
    )
    second = _log(job_store, job_id)[1]
    # its own report wins (it resumed from an older checkpoint): steps 21..24 ran twice
    assert (second["steps_restored"], second["steps_computed"]) == (20, 30)
    assert (second["steps_recomputed"], second["seconds_lost"]) == (4, 2.0)
    expected = StepAccounting(
        steps_computed=54, steps_restored=20, steps_recomputed=4, seconds_lost=2.0
    )
    assert record.accounting == expected
    assert job_store.get(job_id).accounting == expected
    events = job_store.events(job_id, count=100)
    assert events[-1].type == "succeeded"
    assert StepAccounting.model_validate(events[-1].payload["accounting"]) == expected
    reaped = next(e for e in events if e.payload.get("reason") == "lease_expired")
    assert reaped.payload["accounting"]["steps_computed"] == 24  # the sums so far
    after = finished_counts(job_store).steps
    grown = {
        name: after.get((QUEUE, name), 0) - before.get((QUEUE, name), 0)
        for name in ("steps_computed", "steps_restored", "steps_recomputed", "seconds_lost")
    }
    assert grown == {
        "steps_computed": 54,
        "steps_restored": 20,
        "steps_recomputed": 4,
        "seconds_lost": 2.0,
    }


def test_without_checkpoints_every_step_the_first_attempt_ran_is_run_again(
    job_store: JobStore,
) -> None:
    job_id = job_store.create_job(new_job(queue=QUEUE))[0].id
    token = run(job_store, job_id)
    job_store.requeue(job_id, token, HANDED_BACK, steps=AttemptSteps(0, 12, 0.25))
    token = run(job_store, job_id)
    assert _log(job_store, job_id)[1]["steps_restored"] == 0  # nothing to resume from
    record = job_store.succeed(job_id, token, [], {}, steps=AttemptSteps(0, 40, 0.125))
    assert record.accounting == StepAccounting(
        steps_computed=52, steps_restored=0, steps_recomputed=12, seconds_lost=1.5
    )


def test_a_resumed_attempt_that_dies_at_once_computed_nothing(job_store: JobStore) -> None:
    job_id = job_store.create_job(new_job(queue=QUEUE))[0].id
    token = run(job_store, job_id)
    checkpoint(job_store, job_id, token, 10)
    job_store.requeue(job_id, token, HANDED_BACK, steps=AttemptSteps(0, 10, 0.1))
    run(job_store, job_id)
    lapse_lease(job_store, job_id)  # no progress, no checkpoint of its own
    assert job_store.reap(job_id)
    second = _log(job_store, job_id)[1]
    assert (second["steps_restored"], second["steps_reached"], second["steps_computed"]) == (
        10,
        10,
        0,
    )
    assert job_store.get(job_id).accounting == StepAccounting(
        steps_computed=10, steps_restored=10, steps_recomputed=0, seconds_lost=0.0
    )


def test_a_failed_and_a_canceled_attempt_are_counted(job_store: JobStore) -> None:
    job_id = job_store.create_job(new_job(queue=QUEUE))[0].id
    token = run(job_store, job_id)
    job_store.fail(job_id, token, {"type": "Boom", "message": "x"}, steps=AttemptSteps(0, 7, 1.0))
    assert job_store.get(job_id).accounting.steps_computed == 7
    letter = DeadLetterStore(job_store.redis, job_store.settings).get(job_id)
    assert letter is not None
    (run_once,) = letter.attempt_log  # the dead letter keeps each run's figures
    assert (run_once["steps_computed"], run_once["steps_reached"]) == (7, 7)
    other = job_store.create_job(new_job(queue=QUEUE))[0].id
    token = run(job_store, other)
    record = job_store.finish_canceled(other, token, steps=AttemptSteps(0, 3, 1.0))
    assert record.accounting.steps_computed == 3


def test_a_job_that_never_ran_ends_with_zeros(job_store: JobStore) -> None:
    job_id = job_store.create_job(new_job(queue=QUEUE))[0].id
    record = job_store.cancel(job_id)
    assert record.state == JobState.CANCELED
    assert record.accounting == StepAccounting()
    # its event says nothing of steps: a reader takes the missing figures as zeros
    assert job_store.events(job_id, count=10)[-1].payload == {"reason": "requested"}


def test_a_paused_attempt_is_counted_from_its_report(job_store: JobStore) -> None:
    job_id = job_store.create_job(new_job(queue=QUEUE))[0].id
    token = run(job_store, job_id)
    job_store.pause(job_id)  # running: its node stops it at its next step
    record = job_store.pause_stopped(job_id, token, steps=AttemptSteps(0, 9, 0.5))
    assert record.state == JobState.PAUSED
    assert record.accounting == StepAccounting(steps_computed=9)
    assert job_store.events(job_id, count=10)[-1].payload["accounting"]["steps_computed"] == 9
