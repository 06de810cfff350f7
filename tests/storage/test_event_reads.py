"""Reading a job's event stream from its newest end (what a webhook pins when it is queued)."""

from __future__ import annotations

from kiln.common.states import JobState
from kiln.storage.job_store import JobStore
from tests.storage.helpers import job_in_state


def test_latest_events_newest_first(job_store: JobStore) -> None:
    job_id, token = job_in_state(job_store, JobState.RUNNING)
    for step in range(5):
        job_store.set_progress(job_id, token, {"step": step})
    everything = job_store.events(job_id)
    assert job_store.latest_events(job_id, count=3) == everything[::-1][:3]
    assert job_store.latest_events(job_id, count=100) == everything[::-1]
    assert job_store.latest_events("no-such-job") == []
