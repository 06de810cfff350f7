"""A running job's `preview` and `output` events: fenced, in order, at most one preview kept."""

from __future__ import annotations

import pytest

from kiln.common.states import JobState
from kiln.storage.errors import IllegalTransition, StaleLease
from kiln.storage.job_store import JobStore
from tests.storage.helpers import event_types, job_in_state


def preview(step: int) -> dict[str, object]:
    """A small preview event payload."""
    return {"step": step, "total": 9, "image_b64": "x" * 100}


def test_redis_keeps_only_the_newest_preview_of_a_job(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    seqs = []
    for step in range(1, 10):
        job_store.set_progress(job_id, token, {"stage": "denoising", "step": step, "total": 9})
        seqs.append(job_store.add_live_event(job_id, token, "preview", preview(step)))
    events = job_store.events(job_id)
    previews = [e for e in events if e.type == "preview"]
    assert [e.payload["step"] for e in previews] == [9]  # one, the newest
    assert previews[0].seq == seqs[-1]
    assert [e.type for e in events].count("progress") == 9  # other events stay
    raw = job_store.redis.xrange(job_store.keys.events(job_id))
    assert sum(1 for _, fields in raw if fields["type"] == "preview") == 1


def test_a_reader_behind_a_deleted_preview_resumes_at_the_next_event(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    first = job_store.add_live_event(job_id, token, "preview", preview(1))
    second = job_store.add_live_event(job_id, token, "preview", preview(2))
    job_store.set_progress(job_id, token, {"stage": "denoising", "step": 3, "total": 9})
    # a reader whose last event was the first preview (now deleted) reads on from there
    after = job_store.events(job_id, after_seq=first)
    assert [(e.seq, e.type) for e in after] == [(second, "preview"), (second + 1, "progress")]


def test_outputs_are_all_kept_and_precede_the_terminal_event(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    for index in range(3):
        job_store.add_live_event(job_id, token, "output", {"index": index, "key": f"k{index}"})
    job_store.succeed(job_id, token, [{"key": "k0"}], {"run_s": 1})
    assert event_types(job_store, job_id)[-4:] == ["output", "output", "output", "succeeded"]


def test_live_events_are_fenced_and_end_with_the_job(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    with pytest.raises(StaleLease):
        job_store.add_live_event(job_id, token + 1, "preview", preview(1))
    job_store.succeed(job_id, token, [], {})
    with pytest.raises(IllegalTransition):
        job_store.add_live_event(job_id, token, "output", {"index": 0})
    with pytest.raises(IllegalTransition):
        job_store.add_live_event(job_id, token, "other", {})
